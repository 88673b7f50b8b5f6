"""`exo inspect` against a real nats-server: streams, consumers and their lag, KV keys (the
snapshot's sequence), objects, and the server's monitoring endpoint when given."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import uuid
from pathlib import Path

import pytest

from exo.bus.command_queue import send_command
from exo.bus.connection import connect, redact
from exo.bus.event_log import EventLog
from exo.bus.images import store_image
from exo.bus.provision import provision
from exo.bus.server.embedded import EmbeddedNats, nats_server_binary
from exo.bus.snapshots import write_snapshot
from exo.bus.tooling.inspection import Inspection, ServerView, StreamView
from exo.core.commands import PlaceInstance
from exo.core.events import TaskStarted
from exo.core.ids import NodeId
from exo.core.node_names import server_display
from exo.core.state import State
from exo.core.types import NodeInfo
from exo.tools.inspect import inspection_text
from tests.support.exo_process import free_port
from tests.support.exo_tools import in_thread, run_tool

pytestmark = pytest.mark.slow  # starts `exo inspect` processes

IMAGE = b"\x89PNG not really, but bytes all the same"


@pytest.fixture
async def populated(fresh_server: EmbeddedNats):
    """Three events, one command nobody consumed yet, a snapshot and an image; the URL for the
    tool is the read-only operator's."""
    nc = await connect([fresh_server.url], name="test-inspect")
    await provision(nc)
    for n in range(3):
        await EventLog(nc).append(TaskStarted(task_id=f"t{n}"), uuid.uuid4().hex)
    await send_command(nc, PlaceInstance(command_id="waiting", model_id="org/m"))
    assert await write_snapshot(nc, State(last_seq=2)) and await write_snapshot(nc, State(last_seq=3))
    digest, _ = await store_image(nc, IMAGE)
    yield fresh_server.operator_url, digest
    await nc.close()


async def test_inspect_json_shows_streams_consumers_keys_and_objects(populated):
    url, digest = populated
    done = await in_thread(run_tool, ["inspect", "--json"], url)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    streams = {s["name"]: s for s in report["streams"]}
    events = streams["EXO_EVENTS"]
    assert (events["messages"], events["first_seq"], events["last_seq"], events["consumers"]) == (3, 1, 3, [])
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT.+Z", events["last_time"])
    (master,) = streams["EXO_COMMANDS"]["consumers"]
    assert master == {"name": "exo-master", "durable": True, "pull": True, "filter": "exo.commands.>", "lag": 1,
                      "ack_pending": 0, "redelivered": 0, "waiting_pulls": 0, "delivered_seq": 0, "ack_floor_seq": 0}
    (state_bucket,) = [b for b in report["buckets"] if b["bucket"] == "exo-state"]
    (snapshot,) = state_bucket["keys"]
    assert (snapshot["key"], snapshot["revision"], snapshot["revisions_kept"], snapshot["note"]) == \
        ("snapshot", 2, 2, "State at sequence 3")
    adapters, images = report["object_stores"]
    assert (adapters["bucket"], adapters["objects"], images["bucket"]) == ("exo-adapters", [], "exo-images")
    assert [(o["name"], o["size"], o["chunks"]) for o in images["objects"]] == [(digest, len(IMAGE), 1)]
    assert report["server"]["url"] == redact(url) and report["server"]["monitor"] is None


async def test_inspect_text_is_a_readable_report(populated):
    url, digest = populated
    done = await in_thread(run_tool, ["inspect"], url)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith(f"NATS {redact(url)} (nats-server 2.")
    assert re.search(r"^  EXO_EVENTS +3 +\S+ \S+ +1 +3 +\d{4}-\S+Z +0$", done.stdout, re.M)
    assert re.search(r"^  EXO_COMMANDS +exo-master +durable pull +1 +0 +0 +0 +0 +0$", done.stdout, re.M)
    assert re.search(r"^  snapshot +2 +\S+ \S+ +2 +State at sequence 3$", done.stdout, re.M)
    assert re.search(rf"^  {digest} +{len(IMAGE)} B +1 +\S+ +SHA-256=", done.stdout, re.M)
    assert "Object store exo-images: 1 object(s)" in done.stdout


async def test_inspect_reads_the_monitoring_endpoint_when_given(tmp_path: Path):
    port, monitor_port = free_port(), free_port()
    server = subprocess.Popen([nats_server_binary(), "--jetstream", "--store_dir", str(tmp_path), "--addr", "127.0.0.1",
                               "--port", str(port), "--http_port", str(monitor_port), "--server_name", "monitored"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"nats://127.0.0.1:{port}"
        for _ in range(200):
            try:
                nc = await connect([url], name="probe")
                break
            except Exception:
                await asyncio.sleep(0.05)
        await provision(nc)
        await nc.close()
        done = await in_thread(run_tool, ["inspect", "--monitor", f"http://127.0.0.1:{monitor_port}"], url)
        assert done.returncode == 0, done.stderr
        assert re.search(r"^server: server_name=monitored, version=2\.\d+\.\d+, uptime=\S+, connections=1,",
                         done.stdout, re.M)
        wrong = await in_thread(run_tool, ["inspect", "--monitor", "http://127.0.0.1:1"], url)
        assert wrong.returncode == 2
        assert wrong.stderr.startswith("exo inspect: cannot read the NATS monitoring endpoint http://127.0.0.1:1/varz")
    finally:
        server.terminate()
        server.wait(10)


async def test_inspect_lists_the_keys_a_bucket_holds_and_not_the_deleted(fresh_server: EmbeddedNats):
    """Keys come from the bucket's stream (a key per subject), each read directly: a deleted or
    purged key, whose last revision is a marker, is not listed."""
    nc = await connect([fresh_server.url], name="test-inspect-keys")
    await provision(nc)
    assert await write_snapshot(nc, State(last_seq=7))
    state_kv = await nc.jetstream().key_value("exo-state")
    for name in ("deleted", "purged", "kept"):
        await state_kv.put(name, b"x")
    await state_kv.delete("deleted")
    await state_kv.purge("purged")
    await nc.close()
    done = await in_thread(run_tool, ["inspect", "--json"], fresh_server.operator_url)
    assert done.returncode == 0, done.stderr
    (state_bucket,) = [b for b in json.loads(done.stdout)["buckets"] if b["bucket"] == "exo-state"]
    assert [(k["key"], k["note"]) for k in state_bucket["keys"]] == [("kept", ""), ("snapshot", "State at sequence 7")]
    assert state_bucket["keys_left_out"] == 0


def test_inspect_names_a_cluster_s_servers_after_their_nodes_where_state_knows_them():
    """exo-<node id> is the server of that node (exo/bus/server/cluster_node.py): the report names it
    as the node names itself, keeping the follower's note; a server State has no node for keeps its name."""
    studio, mini, gone = "a" * 32, "b" * 32, "c" * 32
    state = State(nodes={NodeId(studio): NodeInfo(node_id=NodeId(studio), name="studio"),
                         NodeId(mini): NodeInfo(node_id=NodeId(mini), name="mini")})
    events = StreamView(name="EXO_EVENTS", subjects=[], storage="file", messages=0, bytes=0, first_seq=0, last_seq=0,
                        last_time="", consumers=[], replicas=3, cluster="exo-c1", leader=f"exo-{studio}",
                        followers=[f"exo-{mini} (offline)", f"exo-{gone} (behind)"])
    inspection = Inspection(server=ServerView(url="nats://h:4222", version="2.15.1", jetstream_storage_bytes=0,
                                              jetstream_memory_bytes=0), streams=[events], buckets=[], object_stores=[])
    assert inspection_text(inspection, state)[2:5] == [
        f"JetStream cluster exo-c1: 3 server(s) hold streams: exo-{gone}, mini, studio",
        "  stream      replicas  leader  followers",
        f"  EXO_EVENTS  3         studio  mini (offline), exo-{gone} (behind)"]
    assert inspection_text(inspection)[4] == \
        f"  EXO_EVENTS  3         exo-{studio}  exo-{mini} (offline), exo-{gone} (behind)"
    assert server_display(state, f"exo-{studio}-witness") == "studio witness"
    assert server_display(state, "nats-1") == "nats-1"
