"""The read-only operator may create consumers (`nats stream view` needs one), so it can make the
server deliver stored messages to any subject as a push consumer's deliver subject, where its
own publish permissions never apply. Nothing exo listens to may act on such a delivery
(exo/bus/inbound.py): a stored event with a `model_id` aimed at `exo.downloads.<node>.delete`
used to delete that model's files."""

from __future__ import annotations

import asyncio
import hashlib
import uuid
from pathlib import Path

import httpx
import msgspec
import nats
import pytest
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from exo.bus.connection import connect
from exo.bus.event_log import EventLog
from exo.bus.provision import provision
from exo.bus.server.embedded import EmbeddedNats
from exo.bus.subjects import EVENTS_STREAM, download_control_subject, model_share_subject, pulse_subject, token_subject
from exo.bus.token_stream import TokenListener
from exo.core.events import CustomCardDeleted, DownloadDeleted, TaskStarted
from exo.core.requests import TokenChunk
from tests.support.cluster import NatsServer, start_node, state_of, wait_until
from tests.support.fake_hub import FakeHub
from tests.support.sharded_model import make_sharded_model

REPO = "exo-test/sharded-llama"
CHAT = {"model": REPO, "messages": [{"role": "user", "content": "Hello"}], "temperature": 0, "max_tokens": 8}


def _tree(path: Path) -> dict[str, tuple[str, int]]:
    """Each file's digest and inode: a file deleted and downloaded again is not the same file."""
    return {p.relative_to(path).as_posix(): (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_ino)
            for p in path.rglob("*") if p.is_file()}


async def _push(operator, filter_subject: str, deliver_subject: str) -> None:
    """What the operator can do: a push consumer replaying stored events into `deliver_subject`."""
    await operator.jetstream().add_consumer(EVENTS_STREAM, ConsumerConfig(
        name=f"push-{uuid.uuid4().hex[:8]}", filter_subject=filter_subject, deliver_subject=deliver_subject,
        deliver_policy=DeliverPolicy.ALL, ack_policy=AckPolicy.NONE))


def _targets(node_id: str) -> list[str]:
    return ([download_control_subject(node_id, action) for action in ("delete", "start", "cancel")]
            + [model_share_subject(node_id, what) for what in ("manifest", "chunk")]
            + [pulse_subject(node_id), pulse_subject("forged-node")])


@pytest.mark.slow  # an exo process downloads, loads and serves a model
def test_push_consumers_aimed_at_a_nodes_subjects_change_nothing(tmp_path: Path):
    server = NatsServer(tmp_path / "nats")
    hub = FakeHub({REPO: make_sharded_model(tmp_path / "repo")})
    hub.start()
    env = {"HF_ENDPOINT": hub.endpoint, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_DISABLE_TELEMETRY": "1"}
    node = start_node(tmp_path, "a", server.url, env=env)
    try:
        with httpx.Client(base_url=node.url, timeout=120) as http:
            node_id = http.get("/node_id").json()
            assert http.post("/models/add", json={"model_id": REPO}).status_code == 200
            # Downloaded and not in use: a delete request would remove it (one in use is refused).
            assert http.post("/download/start", json={"model_id": REPO}).status_code == 200
            wait_until(lambda: (d := state_of(node).download_of(node_id, REPO)) and d.status == "completed", 30,
                       what="the download")
            record = state_of(node).download_of(node_id, REPO)
            model_dir = Path(record.path)
            files_before, before = _tree(model_dir), state_of(node)

            async def attack() -> None:
                exo = await connect([server.url], name="history")
                # Stored events naming the model at top level, as a log holds them (a deleted card, a
                # node's removed download): exactly a download request's one field. Both are skipped
                # by the reducer here (no term; no such download), so only a delivery could act.
                await EventLog(exo).append(CustomCardDeleted(model_id=REPO), uuid.uuid4().hex)
                await EventLog(exo).append(DownloadDeleted(node_id="gone", model_id=REPO), uuid.uuid4().hex)
                await exo.close()
                operator = await nats.connect(server.server.operator_url, max_reconnect_attempts=-1)
                for target in _targets(node_id):
                    for kind in ("card.deleted", "download.deleted", "node.heartbeat"):
                        await _push(operator, f"exo.events.{kind}", target)
                await asyncio.sleep(3)  # every delivery made (and redelivered) meanwhile
                await operator.close()

            asyncio.run(attack())
            assert _tree(model_dir) == files_before
            after = state_of(node)
            assert after.download_of(node_id, REPO) == before.download_of(node_id, REPO)
            assert set(after.nodes) == {node_id} and after.custom_model_cards == before.custom_model_cards
            assert "dropped" in node.output() and "push consumer" in node.output()
            placed = http.post("/place_instance", json={"model_id": REPO, "wait": 60})  # the model still serves
            assert placed.status_code == 200, placed.text
            chat = http.post("/v1/chat/completions", json=CHAT)
            assert chat.status_code == 200 and chat.json()["choices"][0]["message"]["content"]
    finally:
        node.interrupt()
        hub.stop()
        server.stop()


async def test_a_push_consumer_cannot_put_stored_messages_into_a_live_generation(fresh_server: EmbeddedNats):
    exo = await connect([fresh_server.url], name="exo")
    await provision(exo)
    # A chunk-shaped message stored in a stream the operator can read (as exo: history stands in).
    forged = TokenChunk(command_id="victim", index=0, text="INJECTED")
    await exo.jetstream().publish("exo.events.task.started", msgspec.json.encode(forged), stream=EVENTS_STREAM)
    await EventLog(exo).append(TaskStarted(task_id="x"), uuid.uuid4().hex)
    listener = await TokenListener.live(exo, "victim")
    operator = await nats.connect(fresh_server.operator_url, max_reconnect_attempts=-1)
    try:
        await _push(operator, "exo.events.task.started", token_subject("victim"))
        assert await listener.next_within(2) is None
        real = TokenChunk(command_id="victim", index=0, text="real")
        await exo.publish(token_subject("victim"), msgspec.json.encode(real), reply=exo.new_inbox())
        assert await listener.next_within(5) == real
    finally:
        await listener.close()
        await operator.close()
        await exo.close()
