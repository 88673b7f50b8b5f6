"""Discovery on the LAN (mDNS, here bound to 127.0.0.1) and the pure choice of who forms the cluster."""

from __future__ import annotations

import asyncio

from exo.bus.server.cluster_formation import Announcement, Join, Seed, Wait, choose_role
from exo.bus.server.discovery import Discovery
from tests.conftest import eventually


def peer(node_id: str, state="ready", cluster="exo-a", namespace="default", port=6222) -> Announcement:
    return Announcement(node_id=node_id, namespace=namespace, state=state, cluster=cluster if state == "ready" else "",
                        host="10.0.0.1", cluster_port=port)


def test_the_first_node_seeds_a_cluster_named_after_itself():
    assert choose_role("b", "default", []) == Seed(cluster="exo-b")
    assert choose_role("b", "default", [peer("c", "starting")]) == Seed(cluster="exo-b")  # larger ids wait for b


def test_a_node_waits_for_a_smaller_id_that_is_starting_then_joins_it_once_ready():
    assert choose_role("b", "default", [peer("a", "starting")]) == Wait(reason="node a goes first")
    joined = choose_role("b", "default", [peer("a", "ready", "exo-a")])
    assert joined == Join(cluster="exo-a", routes=["nats-route://10.0.0.1:6222"])


def test_a_node_joins_the_ready_members_of_the_biggest_cluster_and_ignores_other_namespaces():
    peers = [peer("a", cluster="exo-a", port=1), peer("c", cluster="exo-c", port=2), peer("d", cluster="exo-c", port=3),
             peer("zz", "starting"), peer("0", cluster="exo-0", namespace="lab", port=4)]
    assert choose_role("z", "default", peers) == Join(
        cluster="exo-c", routes=["nats-route://10.0.0.1:2", "nats-route://10.0.0.1:3"])
    assert choose_role("z", "lab", peers) == Join(cluster="exo-0", routes=["nats-route://10.0.0.1:4"])
    assert choose_role("a", "default", [peer("a", cluster="exo-a")]) == Seed(cluster="exo-a")  # itself is no peer


def test_one_node_at_a_time_seeds_or_joins_smallest_id_first():
    cluster = [peer("a", cluster="exo-a")]
    assert choose_role("c", "default", [*cluster, peer("b", "starting")]) == Wait(reason="node b goes first")
    assert choose_role("b", "default", [*cluster, peer("c", "starting")]) == Join(
        cluster="exo-a", routes=["nats-route://10.0.0.1:6222"])
    # whoever is joining (or seeding) now goes on alone, whatever its id
    assert choose_role("a", "default", [peer("z", "joining")]) == Wait(reason="node z is joining")
    assert choose_role("b", "default", [*cluster, peer("z", "joining")]) == Wait(reason="node z is joining")


async def test_nodes_on_one_namespace_hear_each_other_and_their_changes_and_other_namespaces_stay_apart():
    a, b, other = Discovery(["127.0.0.1"]), Discovery(["127.0.0.1"]), Discovery(["127.0.0.1"])
    me_a = Announcement(node_id="a1", namespace="test-ns", host="127.0.0.1", cluster_port=16222)
    me_b = Announcement(node_id="b1", namespace="test-ns", host="127.0.0.1", cluster_port=16223)
    stranger = Announcement(node_id="c1", namespace="elsewhere", host="127.0.0.1", cluster_port=16224)
    running = [a, b, other]
    try:
        await asyncio.gather(a.start(me_a), b.start(me_b), other.start(stranger))
        await eventually(lambda: a.peers() == [me_b] and b.peers() == [me_a], 10, 0.05, what="a and b hearing each other")
        assert [p.node_id for p in other.peers()] == []  # heard, but not its namespace
        ready = Announcement(node_id="a1", namespace="test-ns", state="ready", cluster="exo-a1", host="127.0.0.1",
                             cluster_port=16222)
        await a.announce(ready)
        await eventually(lambda: b.peers() == [ready], 10, 0.05, what="b hearing a ready")
        assert choose_role("b1", "test-ns", b.peers()) == Join(cluster="exo-a1", routes=["nats-route://127.0.0.1:16222"])
        await a.stop()
        running.remove(a)
        await eventually(lambda: b.peers() == [], 10, 0.05, what="b hearing a's goodbye")
    finally:
        for discovery in running:
            await discovery.stop()
