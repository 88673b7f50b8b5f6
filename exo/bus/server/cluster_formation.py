"""Who forms the cluster: a pure decision over the exo nodes discovery found on the LAN.

A node that finds a ready peer joins that peer's cluster (routes to its ready members). One that
finds none seeds a cluster named after itself, unless a peer with a smaller node id is still
starting: that one seeds, and this one joins it once it is ready. Joins happen one at a time,
smallest node id first: a node goes only when no peer is "joining" (seeding or joining now) and
no smaller one is still "starting", and it announces "ready" only once it is a member of the
JetStream meta group (four nodes joining at once once outvoted the seed, and its streams
vanished).
"""

from __future__ import annotations

from typing import Literal

import msgspec

NodeState = Literal["starting", "joining", "ready"]


class Announcement(msgspec.Struct, frozen=True, kw_only=True):
    """What a node says of itself on the LAN (mDNS TXT record, exo/bus/server/discovery.py)."""

    node_id: str
    namespace: str = "default"  # two clusters on one LAN stay apart
    secret_id: str = ""  # a digest of the cluster secret: nodes with different secrets never pair
    state: NodeState = "starting"
    cluster: str = ""  # the NATS cluster it belongs to; "" while starting
    host: str = ""  # where its NATS cluster port listens
    cluster_port: int = 0

    @property
    def route(self) -> str:
        return f"nats-route://{self.host}:{self.cluster_port}"


class Seed(msgspec.Struct, frozen=True, kw_only=True):
    cluster: str


class Join(msgspec.Struct, frozen=True, kw_only=True):
    cluster: str
    routes: list[str]


class Wait(msgspec.Struct, frozen=True, kw_only=True):
    reason: str


Role = Seed | Join | Wait


def choose_role(me: str, namespace: str, peers: list[Announcement]) -> Role:
    """What node `me` does, given the peers it has heard (its own announcement excluded)."""
    mine = [p for p in peers if p.namespace == namespace and p.node_id != me]
    clusters: dict[str, list[Announcement]] = {}
    for peer in mine:
        if peer.state == "ready" and peer.cluster:
            clusters.setdefault(peer.cluster, []).append(peer)
    joining = sorted(p.node_id for p in mine if p.state == "joining")
    if joining:  # seeding or joining now: one at a time
        return Wait(reason=f"node {joining[0]} is joining")
    ahead = sorted(p.node_id for p in mine if p.state == "starting" and p.node_id < me)
    if ahead:
        return Wait(reason=f"node {ahead[0]} goes first")
    if clusters:
        # Two clusters seen at once (formed apart): the bigger wins, then the smaller name; the
        # other keeps its own (joining both would merge them, and one side's streams vanish).
        name = min(clusters, key=lambda c: (-len(clusters[c]), c))
        return Join(cluster=name, routes=sorted(p.route for p in clusters[name]))
    return Seed(cluster=f"exo-{me}")
