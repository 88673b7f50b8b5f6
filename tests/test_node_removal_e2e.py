"""`exo node remove` on a live cluster: a head (master and API) and two worker nodes on one
nats-server of the test's own. The node generating a greedy chat is removed with the CLI
mid-generation: the client's text still equals mlx-lm's exactly (the generation moves to the other
node), State no longer has the node and keeps its removal, the node says who removed it and why
and stops, a heartbeat appended for it with the shared credential does not bring it back, and it
refuses to start again as that node."""

from __future__ import annotations

import asyncio
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from exo.bus.connection import connect
from exo.bus.event_log import EventLog
from exo.bus.server.node_keys import load_node_key
from exo.core.events import NodeHeartbeat
from exo.core.types import NodeInfo
from tests.support.e2e import Reference
from tests.support.exo_process import ExoProcess, exo_command
from tests.support.healing import SharedNatsCluster, Streamed, chat_body, node_id_of, state_of, stream_chat, wait_until
from tests.support.tiny_model import Dims, make_tiny_model

pytestmark = pytest.mark.slow

MAX_TOKENS = 1000  # ~3 s of decoding on CPU: the removal lands well inside it
SEA = [{"role": "user", "content": "tell me about the sea"}]
CUT_AFTER_CHUNKS = 20
REASON = "decommissioned"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("model") / "tiny4", Dims(layers=4))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, model_dir) -> Iterator[SharedNatsCluster]:
    cluster = SharedNatsCluster(tmp_path_factory.mktemp("removal"), model_dir, count=2)
    try:
        yield cluster.start()
    finally:
        cluster.stop()


def exo_node(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*exo_command(), "node", *args], capture_output=True, text=True, timeout=60)


def _mid_stream(stream: Streamed) -> None:
    wait_until(lambda: stream.text_chunks() >= CUT_AFTER_CHUNKS or stream.done.is_set(), 60, 0.005,
               "the stream under way")
    assert not stream.done.is_set(), "the stream ended before the node could be removed"


def _heartbeat_as(nats_url: str, node_id: str) -> int:
    """What a removed machine still can with the shared credential: describe itself again."""
    async def append() -> int:
        nc = await connect([nats_url], name="removed-node")
        try:
            event = NodeHeartbeat(node=NodeInfo(node_id=node_id, hostname="back-again", memory_available=10**10))
            return await EventLog(nc).append(event, uuid.uuid4().hex)
        finally:
            await nc.close()
    return asyncio.run(append())


def test_a_node_removed_mid_generation_leaves_for_good_and_the_text_is_exact(cluster, model_dir):
    expected = Reference(model_dir).chat(SEA, MAX_TOKENS)
    head = cluster.head
    instance_id = cluster.place(head)["instance_id"]
    victim: ExoProcess = cluster.hosts(instance_id, head)[0]
    victim_id = node_id_of(victim)
    survivor = next(n for n in cluster.nodes if n is not victim)
    name = state_of(head).nodes[victim_id].name
    stream = stream_chat(head.url, chat_body(SEA, MAX_TOKENS))
    _mid_stream(stream)
    removed = exo_node("remove", name, "--reason", REASON, "--url", head.url)
    assert removed.returncode == 0, removed.stderr
    assert removed.stdout.strip() == (f"removed node {name} ({victim_id}) by an admin (no API keys set) via the API "
                                      f"of node {node_id_of_api(head)}: {REASON}")
    assert stream.done.wait(90), f"the stream did not end ({len(stream.text)} chars so far)"
    assert stream.status == 200 and not stream.errors, stream.errors
    assert stream.text == expected and stream.finish_reason == "length"

    state = state_of(head)
    task = state.tasks[stream.task_id]
    assert len(task.migrations) == 1 and task.migrations[0].from_instance == instance_id
    assert "was removed by an admin (no API keys set) via the API of node" in task.migrations[0].reason
    assert victim_id not in state.nodes and state.revoked_nodes[victim_id].reason == REASON
    assert state.revoked_nodes[victim_id].public_key == victim_key(victim)
    assert all(s.node_id != victim_id for i in state.instances.values() for s in i.shards)
    # The run that took over read what the removed node streamed before (its key still verifies
    # those): none of its chunks was taken for a forgery, here or at the API node.
    assert "dropped a forged token chunk" not in survivor.output() + head.output()
    # The node stops by itself, saying who removed it and why.
    assert victim.wait_exit(30) == 1
    assert f"node {victim_id} was removed from the cluster by an admin (no API keys set) via the API of node " \
           in victim.output() and f": {REASON}: its worker, runners and API stop" in victim.output()

    seq = _heartbeat_as(cluster.nats.url, victim_id)
    wait_until(lambda: state_of(head).last_seq >= seq, 10, 0.1, "the heartbeat folded")
    state = state_of(head)
    assert victim_id not in state.nodes
    assert any(s.seq == seq and "was removed" in s.reason for s in state.skipped_events)

    # The API's refusals: no such node (any more), and the node answering the request itself.
    gone = httpx.post(f"{head.url}/nodes/{victim_id}/remove", timeout=30)
    assert gone.status_code == 404 and gone.json()["error"]["param"] == "node", gone.text
    itself = httpx.post(f"{survivor.url}/nodes/{node_id_of(survivor)}/remove", json={"reason": "x"}, timeout=30)
    assert itself.status_code == 409 and "answers this request" in itself.json()["error"]["message"], itself.text
    for body, param in (({"reason": 5}, "reason"), ({"reason": "x" * 1001}, "reason"), ({"reasn": "x"}, None)):
        bad = httpx.post(f"{head.url}/nodes/{node_id_of(survivor)}/remove", json=body, timeout=30)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == param, bad.text
    listed = exo_node("list", "--url", head.url).stdout
    assert f"{victim_id}  -" in listed and "removed by an admin (no API keys set) via the API of node" in listed
    assert f"{node_id_of(survivor)}  {state.nodes[node_id_of(survivor)].name}" in listed, listed
    unknown = exo_node("remove", "nobody", "--url", head.url)
    assert unknown.returncode == 2 and "404 unknown node 'nobody'" in unknown.stderr, unknown.stderr

    # Started again, it refuses: it would come back under the id that was removed.
    victim.launch()
    assert victim.wait_exit(60) == 1
    assert f"exo: node {victim_id} was removed from the cluster by an admin" in victim.output()
    assert "remove node_id and node.nk from" in victim.output()


def node_id_of_api(node: ExoProcess) -> str:
    """How the API names a node that is not in State (the head runs no worker): its short id."""
    return httpx.get(f"{node.url}/node_id", timeout=30).json()[:8]


def victim_key(node: ExoProcess) -> str:
    return load_node_key(node.data_dir).public_key  # the key the node signs its chunks with
