"""Zero-config clusters (issue #21): `exo` with no flags on several nodes of one LAN, here nodes
bound to 127.0.0.1 with their own ports and data dirs, and mDNS on 127.0.0.1.

Three nodes form one cluster and every stream goes to three replicas; a chat is served and
equals mlx-lm; kill -9 of one node leaves the two others serving and taking commands; a fourth
node joins. Four nodes started at once form exactly one cluster, and a node of another
namespace stays apart.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import subprocess
import time
import uuid

import httpx
import pytest

from exo.bus.connection import connect
from exo.bus.provision import stream_configs
from exo.bus.server.embedded import nats_server_binary
from exo.bus.server.membership import load_membership
from exo.core.state import encode_state
from tests.support.cluster import state_of, wait_until
from tests.support.e2e import Reference
from tests.support.exo_process import ExoProcess, free_port_range, interrupt_all
from tests.support.exo_tools import run_tool
from tests.support.fake_hub import FakeHub
from tests.support.healing import kill_9, stop_all
from tests.support.sharded_model import make_sharded_model
from tests.support.tiny_model import Dims, make_tiny_model
from tests.test_dashboard import page  # noqa: F401 (the browser fixture)

pytestmark = pytest.mark.slow

MESSAGES = [{"role": "user", "content": "Hello, cluster"}]
SHARDED_REPO = "exo-test/sharded-llama"


def discovering(namespace: str) -> dict[str, str]:
    return {"EXO_DISCOVERY": "1", "EXO_DISCOVERY_ADDRESS": "127.0.0.1", "EXO_NAMESPACE": namespace}


def start_together(nodes: list[ExoProcess], timeout: float = 150.0) -> list[ExoProcess]:
    """Start every node at once (as machines switched on together) and wait until all are ready."""
    for node in nodes:
        node.log = open(node.log_path, "wb")
        node.process = subprocess.Popen(node.args, stdout=node.log, stderr=subprocess.STDOUT, env=node.env)
    deadline = time.monotonic() + timeout
    for node in nodes:
        while "node ready" not in node.output():
            assert node.process.poll() is None, node.output()
            assert time.monotonic() < deadline, f"{node.data_dir.name} not ready:\n{node.output()}"
            time.sleep(0.1)
    return nodes




def cluster_of(node: ExoProcess) -> str:
    membership = load_membership(node.data_dir / "nats")
    assert membership is not None
    return membership.cluster


def stream_layout(node: ExoProcess) -> dict[str, list[str]]:
    """Every exo stream's servers (leader first), read with the operator's credentials."""

    async def read() -> dict[str, list[str]]:
        nc = await connect([node.nats_url("operator")], name="test-streams")
        try:
            layout = {}
            for config in stream_configs():
                info = json.loads((await nc.request(f"$JS.API.STREAM.INFO.{config['name']}", b"{}", timeout=5)).data)
                cluster = info.get("cluster") or {}
                layout[config["name"]] = [cluster.get("leader", ""), *(r["name"] for r in cluster.get("replicas") or [])]
            return layout
        finally:
            await nc.close()

    with concurrent.futures.ThreadPoolExecutor(1) as thread:  # the browser's sync API holds this thread's loop
        return thread.submit(asyncio.run, read()).result()


def all_streams_on_three(node: ExoProcess) -> bool:
    try:
        return all(len(set(servers) - {""}) == 3 for servers in stream_layout(node).values())
    except Exception:  # a stream between leaders: ask again
        return False


def same_state(nodes: list[ExoProcess]) -> bool:
    return len({encode_state(state_of(node)) for node in nodes}) == 1


def chat(node: ExoProcess) -> str:
    body = {"model": "local/tiny", "messages": MESSAGES, "temperature": 0, "max_tokens": 12}
    reply = httpx.post(f"{node.url}/v1/chat/completions", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]["message"]["content"]


def layout_in_state(node: ExoProcess):
    return state_of(node).cluster


def full_layout(node: ExoProcess, servers: set[str]) -> bool:
    """State shows every stream on three of `servers`, all of them online."""
    layout = layout_in_state(node)
    return ({s.name for s in layout.servers if s.online} == servers and layout.meta_leader in servers
            and len(layout.streams) == len(stream_configs())
            and all(s.replicas == 3 and len({s.leader, *s.followers} & servers) == 3 for s in layout.streams))


class ThreeNodes:
    """Three discovered nodes (and one to start late) with every stream on their three servers."""

    def __init__(self, root, model_dir) -> None:
        self.model_dir = model_dir
        self.expected = Reference(model_dir).chat(MESSAGES, max_tokens=12)
        # a server silent for 5 s is gone for good here (an hour by default)
        env = {**discovering(f"test-{uuid.uuid4().hex[:8]}"), "EXO_PEER_REMOVE_AFTER_S": "5"}
        self.nodes = [ExoProcess(root / f"node-{n}", env) for n in range(3)]
        self.late = ExoProcess(root / "node-late", env)

    def form(self) -> None:
        nodes = self.nodes
        start_together(nodes)
        assert len({cluster_of(node) for node in nodes}) == 1
        wait_until(lambda: all_streams_on_three(nodes[0]), 60, 1.0, "every stream on three servers")
        seed = next(node for node in nodes if load_membership(node.data_dir / "nats").seeded)
        wait_until(lambda: load_membership(seed.data_dir / "nats").witness_retired, 30, 0.5, "the witness retired")
        assert all(not name.endswith("-witness") for servers in stream_layout(nodes[0]).values() for name in servers)
        self.servers = {f"exo-{_node_id(node)}" for node in nodes}
        wait_until(lambda: full_layout(nodes[2], self.servers), 30, 0.5, "the layout in State")


@pytest.fixture(scope="class")
def three_nodes(tmp_path_factory):
    root = tmp_path_factory.mktemp("three-nodes")
    cluster = ThreeNodes(root, make_tiny_model(root / "model"))
    try:
        cluster.form()
        yield cluster
    finally:
        stop_all([*cluster.nodes, cluster.late])


class TestThreeNodesWithNoFlags:
    """One cluster of three: its dashboard first (needs a browser), then, in order and without one,
    a kill, a fourth node and the dead one back."""

    def test_the_dashboard_shows_every_stream_on_three_online_servers(self, three_nodes, page):  # noqa: F811
        page.goto(three_nodes.nodes[1].url + "/")
        page.wait_for_selector('#replicas tr[data-replicas="3"]')
        assert page.locator('#replicas tr[data-replicas="3"]').count() == len(stream_configs())
        assert page.locator('#replicas [data-online="true"]').count() == 3 and not page.errors

    def test_they_serve_survive_a_kill_take_a_fourth_and_the_dead_one_back(self, three_nodes):
        nodes, late, expected, model_dir = three_nodes.nodes, three_nodes.late, three_nodes.expected, three_nodes.model_dir
        inspected = run_tool(["inspect"], nodes[0].nats_url("operator"))
        assert inspected.returncode == 0, inspected.stderr
        assert f"JetStream cluster {cluster_of(nodes[0])}: 3 server(s) hold streams" in inspected.stdout
        assert "EXO_EVENTS" in inspected.stdout.split("JetStream cluster", 1)[1].split("Streams", 1)[0]
        monitored = run_tool(["inspect", "--monitor", monitor_of(nodes[0])], nodes[0].nats_url("operator"))
        assert f"meta_leader={layout_in_state(nodes[0]).meta_leader}" in monitored.stdout, monitored.stdout + monitored.stderr

        added = httpx.post(f"{nodes[0].url}/models/add", json={"model_id": "local/tiny", "path": str(model_dir)}, timeout=60)
        assert added.status_code == 200, added.text
        placed = httpx.post(f"{nodes[1].url}/place_instance", json={"model_id": "local/tiny"}, timeout=120)
        assert placed.status_code == 200, placed.text
        assert [chat(node) for node in nodes] == [expected] * 3
        wait_until(lambda: same_state(nodes), 30, 0.5, "State identical on the three nodes")

        hosting = {runner.node_id for runner in state_of(nodes[0]).runners.values()}
        victim = next(node for node in nodes if _node_id(node) not in hosting)
        survivors = [node for node in nodes if node is not victim]
        kill_9(victim)
        wait_until(lambda: any(s.name == f"exo-{_node_id(victim)}" and not s.online
                               for s in layout_in_state(survivors[0]).servers), 30, 0.5, "the killed server offline in State")
        assert [chat(node) for node in survivors] == [expected] * 2
        second = httpx.post(f"{survivors[0].url}/models/add",
                            json={"model_id": "local/tiny-again", "path": str(model_dir)}, timeout=60)
        assert second.status_code == 200, second.text
        wait_until(lambda: all("local/tiny-again" in _model_ids(node) for node in survivors), 30, 0.5,
                   "a command taken after the kill, seen on both survivors")

        late.start(timeout=150)
        assert cluster_of(late) == cluster_of(survivors[0])
        assert chat(late) == expected
        wait_until(lambda: same_state([*survivors, late]), 30, 0.5, "State identical on the late node")
        # the killed server is gone for good: its replicas moved to the late node, it left the meta group
        now_serving = {f"exo-{_node_id(node)}" for node in [*survivors, late]}
        wait_until(lambda: full_layout(late, now_serving) and len(layout_in_state(late).servers) == 3, 60, 1.0,
                   "every stream on the three live servers, the dead one removed")

        # the removed machine comes back: it rejoins the cluster it kept, catches up and serves at
        # once; nats-server re-admits a removed server to the meta group only ~5 min after its
        # removal, so until then the streams stay on the three servers that hold them
        victim.start(timeout=150)
        assert "rejoining cluster" in victim.output() and cluster_of(victim) == cluster_of(late)
        assert chat(victim) == expected
        wait_until(lambda: same_state([*survivors, late, victim]), 30, 0.5, "State identical on the returned node")
        assert full_layout(victim, now_serving)


def test_four_nodes_started_at_once_form_exactly_one_cluster_and_another_namespace_stays_apart(tmp_path):
    ours = discovering(f"test-{uuid.uuid4().hex[:8]}")
    nodes = [ExoProcess(tmp_path / f"node-{n}", ours) for n in range(4)]
    stranger = ExoProcess(tmp_path / "stranger", discovering(f"other-{uuid.uuid4().hex[:8]}"))
    try:
        start_together([*nodes, stranger])
        assert len({cluster_of(node) for node in nodes}) == 1
        assert cluster_of(stranger) != cluster_of(nodes[0])
        assert cluster_of(stranger) == f"exo-{_node_id(stranger)}"  # it seeded its own
        wait_until(lambda: all_streams_on_three(nodes[0]), 60, 1.0, "every stream on three servers")
        servers = {name for layout in stream_layout(nodes[0]).values() for name in layout}
        assert servers <= {f"exo-{_node_id(node)}" for node in nodes}
        wait_until(lambda: same_state(nodes), 30, 0.5, "State identical on the four nodes")
        assert encode_state(state_of(stranger)) != encode_state(state_of(nodes[0]))
        assert {node.node_id for node in state_of(stranger).nodes.values()} == {_node_id(stranger)}
    finally:
        stop_all([*nodes, stranger])


def _node_id(node: ExoProcess) -> str:
    return (node.data_dir / "node_id").read_text().strip()


def _model_ids(node: ExoProcess) -> list[str]:
    return [m["id"] for m in httpx.get(f"{node.url}/v1/models", timeout=30).json()["data"]]



def monitor_of(node: ExoProcess) -> str:
    ports = next((node.data_dir / "nats" / "ports").glob("*.ports"))
    return json.loads(ports.read_text())["monitoring"][0]


def routes_of(node: ExoProcess) -> list[str]:
    routez = httpx.get(f"{monitor_of(node)}/routez", timeout=10).json()
    return sorted(route.get("remote_name", "") for route in routez.get("routes") or [])


def test_nodes_with_different_secrets_never_pair_and_a_route_without_the_secret_is_refused(tmp_path):
    namespace = f"test-{uuid.uuid4().hex[:8]}"
    first = ExoProcess(tmp_path / "first", {**discovering(namespace), "EXO_CLUSTER_SECRET": "first-secret"})
    second = ExoProcess(tmp_path / "second", {**discovering(namespace), "EXO_CLUSTER_SECRET": "second-secret"})
    intruder = None
    try:
        start_together([first, second])
        assert cluster_of(first) != cluster_of(second)  # each seeded its own
        secret_file = first.data_dir / "nats" / "cluster-secret"
        assert secret_file.read_text() == "first-secret" and secret_file.stat().st_mode & 0o777 == 0o600
        membership = load_membership(first.data_dir / "nats")
        wait_until(lambda: routes_of(first) != [], 30, 0.5, "the seed's route to its witness")
        before = routes_of(first)
        config = tmp_path / "intruder.conf"
        config.write_text(json.dumps({"cluster": {"name": membership.cluster, "listen": "127.0.0.1:-1", "routes": [
            f"nats-route://exo-route:wrong@127.0.0.1:{membership.port}",
            f"nats-route://127.0.0.1:{membership.port}"]}}))
        intruder_log = tmp_path / "intruder.log"
        with open(intruder_log, "wb") as log:
            intruder = subprocess.Popen([nats_server_binary(), "-c", str(config), "-p", "-1", "--server_name", "intruder"],
                                        stdout=log, stderr=subprocess.STDOUT)
        # both of its routes (a wrong password, none at all) were tried and refused by the seed
        refused = f"127.0.0.1:{membership.port} - rid:"
        wait_until(lambda: sum(refused in line and "Route Error 'Authorization Violation'" in line
                               for line in intruder_log.read_text().splitlines()) >= 2, 30, 0.2,
                   "the seed refusing both of the intruder's routes (its log)")
        assert routes_of(first) == before and "intruder" not in before
    finally:
        if intruder is not None:
            intruder.kill()
        stop_all([first, second])


def test_two_discovered_nodes_share_a_model_over_nats_and_run_it_as_one_pipeline(tmp_path):
    """What works across nodes with --nats works on a discovered cluster: a model from the Hub on
    one node reaches the other through NATS (the Hub is down by then), and a two-node pipeline
    instance on the nodes' own advertised addresses gives mlx-lm's greedy text."""
    model_dir = make_sharded_model(tmp_path / "repo", Dims(layers=4))
    messages = [{"role": "user", "content": "tell me about the sea"}]
    expected = Reference(model_dir).chat(messages, max_tokens=16)
    with FakeHub({SHARDED_REPO: model_dir}) as hub:
        base = {**discovering(f"test-{uuid.uuid4().hex[:8]}"), "HF_ENDPOINT": hub.endpoint,
                "HF_HOME": str(tmp_path / "hf"), "HF_HUB_DISABLE_TELEMETRY": "1"}
        nodes = [ExoProcess(tmp_path / f"node-{n}", {**base, "EXO_RING_PORTS": _ring_ports()}) for n in range(2)]
        try:
            start_together(nodes)
            first = nodes[0]
            assert httpx.post(f"{first.url}/models/add", json={"model_id": SHARDED_REPO}, timeout=60).status_code == 200
            started = httpx.post(f"{first.url}/download/start", json={"model_id": SHARDED_REPO}, timeout=60).json()
            wait_until(lambda: (d := state_of(first).download_of(started["node_id"], SHARDED_REPO)) is not None
                       and d.status == "completed", 60, 0.5, "the download from the Hub")
            hub.stop()
            placed = httpx.post(f"{first.url}/place_instance", timeout=180, json={
                "model_id": SHARDED_REPO, "sharding": "pipeline", "min_nodes": 2, "wait": 150})
            assert placed.status_code == 200, placed.text
            shards = state_of(first).instances[placed.json()["instance_id"]].shards
            assert len({shard.node_id for shard in shards}) == 2
            other = next(shard.node_id for shard in shards if shard.node_id != started["node_id"])
            assert state_of(first).download_of(other, SHARDED_REPO).source == f"peer:{started['node_id']}"
            body = {"model": SHARDED_REPO, "messages": messages, "temperature": 0, "max_tokens": 16}
            for node in nodes:
                reply = httpx.post(f"{node.url}/v1/chat/completions", json=body, timeout=120)
                assert reply.status_code == 200, reply.text
                assert reply.json()["choices"][0]["message"]["content"] == expected
        finally:
            stop_all(nodes)


def _ring_ports() -> str:
    first = free_port_range(21)
    return f"{first}-{first + 20}"


def test_the_master_machine_dies_then_the_whole_cluster_restarts_and_comes_back_with_its_log(tmp_path):
    """The acting master's machine dies: another takes over, and the machine rejoins when it is
    back. Then every machine is switched off and on again: each rejoins the cluster it kept in
    its data dir (no new seed, no merge), at three replicas, with everything the log held."""
    model_dir = make_tiny_model(tmp_path / "model")
    env = discovering(f"test-{uuid.uuid4().hex[:8]}")
    nodes = [ExoProcess(tmp_path / f"node-{n}", env, ["--no-worker"]) for n in range(3)]
    try:
        start_together(nodes)
        name = cluster_of(nodes[0])
        wait_until(lambda: all_streams_on_three(nodes[0]), 60, 1.0, "every stream on three servers")
        # (until the witness retires the seed's machine holds two of the four meta votes)
        seed = next(node for node in nodes if load_membership(node.data_dir / "nats").seeded)
        wait_until(lambda: load_membership(seed.data_dir / "nats").witness_retired, 30, 0.5, "the witness retired")
        added = httpx.post(f"{nodes[1].url}/models/add", json={"model_id": "local/kept", "path": str(model_dir)}, timeout=60)
        assert added.status_code == 200, added.text

        # failover on a discovered cluster: the acting master's machine dies; another node's
        # master takes over and the next command is answered; the dead machine then rejoins
        leader = state_of(nodes[0]).leader_node
        victim = next(node for node in nodes if _node_id(node) == leader)
        kill_9(victim)
        others = [node for node in nodes if node is not victim]
        after = httpx.post(f"{others[0].url}/models/add", json={"model_id": "local/after-failover", "path": str(model_dir)},
                           timeout=90)
        assert after.status_code == 200, after.text
        wait_until(lambda: state_of(others[1]).leader_node not in ("", leader), 30, 0.5, "the new master in every view")
        victim.start(timeout=150)
        assert "rejoining cluster" in victim.output() and cluster_of(victim) == name
        wait_until(lambda: "local/after-failover" in _model_ids(victim), 30, 0.5, "the rejoined node caught up")
        assert interrupt_all(nodes) == [0, 0, 0]  # every machine switched off
        start_together(nodes)
        assert all("rejoining cluster" in node.output() for node in nodes)
        assert {cluster_of(node) for node in nodes} == {name}
        wait_until(lambda: all_streams_on_three(nodes[2]), 60, 1.0, "every stream on three servers again")
        assert all({"local/kept", "local/after-failover"} <= set(_model_ids(node)) for node in nodes)
    finally:
        stop_all(nodes)
