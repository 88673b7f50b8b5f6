"""`--join HOST:PORT`: a node becomes a full member of a cluster named by one member's cluster port,
with no mDNS (exo/bus/server/join.py). The cluster name comes from that port's INFO line; a
client port, a dead port or a wrong secret stop the start with the reason; three nodes joined so,
none heard over mDNS, put every stream on three replicas and lose any one of them.
"""

from __future__ import annotations

import asyncio
import socket
import uuid

import httpx
import pytest

from exo.bus.errors import BusError
from exo.bus.server.cluster_formation import Join
from exo.bus.server.embedded import EmbeddedNats
from exo.bus.server.jetstream_cluster import redundancy
from exo.bus.server.join import join_role
from exo.bus.server.server_config import ClusterLink, route_url
from exo.main import parse_args
from tests.support.cluster import wait_until
from tests.support.exo_process import ExoProcess
from tests.support.healing import kill_9, stop_all
from tests.support.tiny_model import make_tiny_model
from tests.test_cluster_discovery import all_streams_on_three, cluster_of


def _dead_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


@pytest.fixture
async def clustered_server(tmp_path):
    """A real nats-server in cluster mode (its one route leads nowhere: it stays up, alone)."""
    server = EmbeddedNats(tmp_path / "nats", port=0, server_name="exo-seed", cluster=ClusterLink(
        name="exo-here", host="127.0.0.1", port=0, secret="s3cret", routes=[route_url("127.0.0.1", _dead_port())]))
    await server.start()
    yield server
    server.stop()


async def test_the_cluster_port_names_the_cluster_to_join(clustered_server):
    assert clustered_server.cluster is not None
    port = clustered_server.cluster.port
    assert await join_role(f"127.0.0.1:{port}", 5) == Join(cluster="exo-here", routes=[f"nats-route://127.0.0.1:{port}"])


async def test_a_client_port_is_refused_with_the_port_to_give(clustered_server):
    with pytest.raises(BusError, match="this is a NATS client port; --join takes a member's cluster port"):
        await join_role(f"127.0.0.1:{clustered_server.port}", 5)


async def test_a_port_where_no_server_answers_is_refused_after_the_timeout():
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(BusError, match=r"no cluster port answers there within 1 s"):
        await join_role(f"127.0.0.1:{_dead_port()}", 1.0)
    assert 1.0 <= loop.time() - started < 4.0


async def test_a_port_that_is_not_nats_is_refused():
    async def greet(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"SSH-2.0-OpenSSH_9.6\r\n")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(greet, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server:
        with pytest.raises(BusError, match="not a NATS server"):
            await join_role(f"127.0.0.1:{port}", 2)


def test_join_makes_a_cluster_member_even_without_discovery(tmp_path):
    config = parse_args(["--data-dir", str(tmp_path), "--no-discovery", "--join", "10.0.0.7:6222"], {})
    assert config.discovery is not None and config.nats_urls == []
    assert (config.discovery.join, config.discovery.mdns) == ("10.0.0.7:6222", False)
    assert parse_args(["--data-dir", str(tmp_path), "--no-discovery"], {}).discovery is None


@pytest.mark.parametrize(("argv", "message"), [
    (["--join", "10.0.0.7:6222", "--nats", "nats://10.0.0.7:4222"], "--nats (EXO_NATS_URL) makes it a client"),
    (["--join", "10.0.0.7"], "'10.0.0.7' is not HOST:PORT"),
    (["--join", "10.0.0.7:99999"], "'10.0.0.7:99999' is not HOST:PORT"),
])
def test_a_join_that_cannot_work_stops_the_start(tmp_path, argv, message, capsys):
    with pytest.raises(SystemExit) as stopped:
        parse_args(["--data-dir", str(tmp_path), *argv], {})
    assert stopped.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.slow
def test_three_nodes_joined_by_address_without_mdns_hold_every_stream_and_lose_the_first(tmp_path):
    env = {"EXO_DISCOVERY_ADDRESS": "127.0.0.1", "EXO_NAMESPACE": f"join-{uuid.uuid4().hex[:8]}",
           "EXO_CLUSTER_SECRET": "join-test-secret", "EXO_JOIN_TIMEOUT_S": "3"}
    seed = ExoProcess(tmp_path / "seed", {**env, "EXO_DISCOVERY": "1"}).start()  # seeds; hears no one over mDNS
    nodes = [seed]
    try:
        first = _join_address(seed)
        second = ExoProcess(tmp_path / "second", env, ["--no-discovery", "--join", first]).start(timeout=120)
        nodes.append(second)
        # any member's address will do: the third joins through the second
        third = ExoProcess(tmp_path / "third", env, ["--no-discovery", "--join", _join_address(second)]).start(timeout=120)
        nodes.append(third)
        assert cluster_of(second) == cluster_of(third) == cluster_of(seed)
        wait_until(lambda: all_streams_on_three(second), 60, 1.0, "every stream on three servers")
        wait_until(lambda: "the witness" in seed.output() and "is retired" in seed.output(), 30, 0.5, "witness retired")
        wait_until(lambda: _health_body(second).get("redundancy") == "3 replicas of the event log", 20, 0.5,
                   "/health saying the event log's three replicas")

        intruder = ExoProcess(tmp_path / "intruder", {**env, "EXO_CLUSTER_SECRET": "another"},
                              ["--no-discovery", "--join", first])
        with pytest.raises(RuntimeError, match="is this node's cluster secret, or namespace in trusted-LAN mode, the same"):
            intruder.start(timeout=60)

        kill_9(seed)
        wait_until(lambda: _health(second) == 200 and _health(third) == 200, 40, 0.5, "survivors healthy")
        model = str(make_tiny_model(tmp_path / "model"))
        added = httpx.post(f"{third.url}/models/add", json={"model_id": "local/after-the-loss", "path": model}, timeout=60)
        assert added.status_code == 200, added.text
        wait_until(lambda: "local/after-the-loss" in httpx.get(f"{second.url}/v1/models", timeout=10).text, 20, 0.5,
                   "the write after the loss seen on the other survivor")
    finally:
        stop_all(nodes)


def _join_address(node: ExoProcess) -> str:
    line = next(line for line in node.output().splitlines() if "another node joins it as a member with --join" in line)
    return line.split("--join ", 1)[1].split(" ", 1)[0]


def _health_body(node: ExoProcess) -> dict[str, object]:
    body: dict[str, object] = httpx.get(f"{node.url}/health", timeout=5).json()
    return body


@pytest.mark.slow
async def test_a_node_on_a_nats_url_with_one_replica_says_it_has_no_redundancy(tmp_path):
    """--nats makes a plain client: on a single server's JetStream, the banner and /health say that
    losing it stops the cluster, and how to get redundancy."""
    server = EmbeddedNats(tmp_path / "nats", port=0)
    await server.start()
    try:
        client = ExoProcess(tmp_path / "client", {"EXO_NATS_URL": server.url}).start()
        try:
            risks = [line for line in client.output().splitlines() if line.startswith("  risk: no redundancy")]
            assert risks == [f"  risk: no redundancy: {redundancy(1).removeprefix('none: ')}"]
            assert "--join HOST:PORT or discovery" in risks[0]
            assert _health_body(client)["redundancy"] == redundancy(1)
        finally:
            stop_all([client])
    finally:
        server.stop()


def _health(node: ExoProcess) -> int:
    try:
        return httpx.get(f"{node.url}/health", timeout=5).status_code
    except httpx.HTTPError:
        return 0

