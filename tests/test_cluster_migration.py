"""A single standalone node upgraded to the clustered layout (issue #21) keeps its log (every
event at its sequence), its custom cards, its instances and its images, and serves the same
chat; a restart afterwards rejoins its cluster without migrating again."""

from __future__ import annotations

import asyncio
import base64
import json
import uuid
from pathlib import Path

import httpx
import pytest

from exo.bus.connection import connect
from exo.bus.errors import BusError
from exo.bus.event_log import EventLog
from exo.bus.provision import provision
from exo.bus.server import cluster_node
from exo.bus.server.cluster_node import ClusterNode, DiscoverySettings
from exo.bus.server.embedded import EmbeddedNats
from exo.bus.server.membership import load_membership
from exo.bus.server.migration import BACKUP_DIR, migrate_standalone_store
from exo.bus.subjects import EVENTS_STREAM
from exo.core.events import TaskStarted
from tests.support.cluster import state_of, wait_until
from tests.support.exo_process import ExoProcess
from tests.support.tiny_model import make_tiny_model

pytestmark = pytest.mark.slow

BODY = {"model": "local/tiny", "messages": [{"role": "user", "content": "Before and after"}], "temperature": 0,
        "max_tokens": 12}
IMAGE = bytes(range(256)) * 4096  # 1 MiB: several object-store chunks


def chat(node: ExoProcess) -> str:
    reply = httpx.post(f"{node.url}/v1/chat/completions", json=BODY, timeout=120)
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]["message"]["content"]


async def _log_and_image(url: str, put_image: bool, read_image: bool) -> tuple[list[tuple[int, str, str]], bytes]:
    nc = await connect([url], name="test-migration")
    try:
        js = nc.jetstream()
        store = await js.object_store("exo-images")
        if put_image:
            await store.put("test-image", IMAGE)
        last = (await js.stream_info("EXO_EVENTS")).state.last_seq
        events = []
        for seq in range(1, last + 1):
            reply = json.loads((await nc.request("$JS.API.STREAM.MSG.GET.EXO_EVENTS", json.dumps({"seq": seq}).encode())).data)
            if "message" in reply:  # (a hole: an event deleted on purpose by a test)
                events.append((seq, reply["message"]["subject"], reply["message"]["data"]))
        return events, ((await store.get("test-image")).data or b"") if read_image else b""
    finally:
        await nc.close()


def log_and_image(node: ExoProcess, put_image: bool = False, read_image: bool = True) -> tuple[list[tuple[int, str, str]], bytes]:
    return asyncio.run(_log_and_image(node.nats_url(), put_image, read_image))


def test_a_standalone_node_upgraded_to_a_cluster_keeps_log_cards_instances_and_images(tmp_path):
    model_dir = make_tiny_model(tmp_path / "model")
    data_dir = tmp_path / "node"
    standalone = ExoProcess(data_dir, {"EXO_DISCOVERY": "0"}).start()
    try:
        added = httpx.post(f"{standalone.url}/models/add", json={"model_id": "local/tiny", "path": str(model_dir)}, timeout=60)
        assert added.status_code == 200, added.text
        placed = httpx.post(f"{standalone.url}/place_instance", json={"model_id": "local/tiny"}, timeout=120)
        instance = placed.json()["instance_id"]
        before = chat(standalone)
        old_log, image = log_and_image(standalone, put_image=True)
        assert image == IMAGE and len(old_log) > 5
    finally:
        assert standalone.interrupt() == 0

    env = {"EXO_DISCOVERY": "1", "EXO_DISCOVERY_ADDRESS": "127.0.0.1", "EXO_NAMESPACE": f"test-{uuid.uuid4().hex[:8]}"}
    clustered = ExoProcess(data_dir, env).start(timeout=150)
    try:
        assert "carrying it into cluster" in clustered.output()
        membership = load_membership(data_dir / "nats")
        assert membership is not None and membership.seeded
        assert (data_dir / BACKUP_DIR / "jetstream").exists()  # the old store, kept
        new_log, image = log_and_image(clustered)
        assert new_log[:len(old_log)] == old_log  # every event, at its sequence
        assert image == IMAGE
        state = state_of(clustered)
        assert "local/tiny" in state.custom_model_cards and list(state.instances) == [instance]
        wait_until(lambda: [r.status for r in state_of(clustered).runners.values()] == ["ready"], 60, 0.5, "runner ready")
        assert chat(clustered) == before
        assert base64.b64decode(old_log[0][2])  # (events are real payloads, not empty)
    finally:
        assert clustered.interrupt() == 0

    again = ExoProcess(data_dir, env).start(timeout=150)
    try:
        assert "carrying it into cluster" not in again.output() and "rejoining cluster" in again.output()
        assert load_membership(data_dir / "nats") == membership
        assert list(state_of(again).instances) == [instance]
        assert chat(again) == before
    finally:
        again.interrupt()



async def _standalone_store(store: Path) -> list[int]:
    """A store an earlier, standalone exo wrote: exo's streams with a few events in the log."""
    server = EmbeddedNats(store, port=0)
    await server.start()
    nc = await connect([server.url], name="test-standalone")
    try:
        await provision(nc)
        log = EventLog(nc)
        return [await log.append(TaskStarted(task_id=f"t{n}"), f"event-{n}") for n in range(5)]
    finally:
        await nc.close()
        server.stop()


def _settings() -> DiscoverySettings:
    return DiscoverySettings(address="127.0.0.1", secret="s", secret_id=f"test-{uuid.uuid4().hex[:8]}",
                             namespace=f"test-{uuid.uuid4().hex[:8]}", browse_s=0.2)


async def _log_of(store: Path) -> int:
    server = EmbeddedNats(store, port=0)
    await server.start()
    nc = await connect([server.url], name="test-standalone-again")
    try:
        return (await nc.jetstream().stream_info(EVENTS_STREAM)).state.last_seq
    finally:
        await nc.close()
        server.stop()


async def test_a_migration_that_fails_midway_puts_the_standalone_store_back_as_it_was(tmp_path, monkeypatch):
    store = tmp_path / "node" / "nats"
    appended = await _standalone_store(store)
    copied = []

    async def copy_then_fail(store_dir: Path, cluster_nc) -> None:  # the copy breaks after the log went over
        await migrate_standalone_store(store_dir, cluster_nc)
        copied.append(True)
        raise BusError("disk full (injected)")

    monkeypatch.setattr(cluster_node, "migrate_standalone_store", copy_then_fail)
    node = ClusterNode(store, "a1", 0, _settings())
    with pytest.raises(BusError, match="injected"):
        await node.start()
    await node.discovery.stop()
    assert copied and load_membership(store) is None
    assert not (store.parent / BACKUP_DIR).exists() and not (store.parent / "nats-witness").exists()
    assert await _log_of(store) == appended[-1] == 5  # the standalone log, whole, where it was


async def test_a_migration_that_cannot_start_saves_nothing(tmp_path):
    store = tmp_path / "node" / "nats"
    await _standalone_store(store)
    (store.parent / BACKUP_DIR).mkdir()  # an earlier migration's backup still there
    node = ClusterNode(store, "a1", 0, _settings())
    with pytest.raises(BusError, match="exists from an earlier migration"):
        await node.start()
    await node.discovery.stop()
    assert load_membership(store) is None  # (a saved membership would make the next start skip the migration)
    assert await _log_of(store) == 5
