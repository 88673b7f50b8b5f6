"""Late join: snapshot plus tail gives exactly the State a full replay gives, and a worker
makes its disk match State (custom cards, images) before it plans anything."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import os
import threading
from pathlib import Path

import httpx
import pytest

from exo.bus.connection import connect
from exo.bus.event_log import EventLog
from exo.bus.snapshots import read_latest_snapshot
from exo.core.events import NodeRegistered, TaskCreated, TaskFinished
from exo.core.requests import GenerationParams
from exo.core.types import NodeInfo, Task
from tests.support.cluster import NatsServer, log_line, node_process, replay, start_node, state_of, wait_until
from tests.support.exo_process import interrupt_all, start_all
from tests.support.vision_model import VisionReference, make_vision_model, png

pytestmark = pytest.mark.slow


@pytest.fixture
def nats(tmp_path: Path):
    server = NatsServer(tmp_path / "nats")
    yield server
    server.stop()


def append_history(nats_url: str, count: int, term: int) -> int:
    """`count` events of the kinds a busy cluster writes, appended 200 at a time (the master's
    kinds with the leading `term`, as the master stamps them)."""

    def event(n: int):
        if n % 50 == 0:
            return NodeRegistered(node=NodeInfo(node_id=f"node-{n % 7}", memory_available=n))
        if n % 2:
            return TaskCreated(term=term, task=Task(task_id=f"t{n}", instance_id="i", model_id="m",
                                         params=GenerationParams(max_tokens=n)))
        return TaskFinished(task_id=f"t{n - 1}", status="completed", completion_tokens=n)

    async def run() -> int:
        nc = await connect([nats_url], name="history")
        log = EventLog(nc)
        last = 0
        for start in range(0, count, 200):
            seqs = await asyncio.gather(*(log.append(event(n), f"h{n}") for n in range(start, min(count, start + 200))))
            last = max(seqs)
        await nc.close()
        return last

    return asyncio.run(run())


def latest_snapshot_seq(nats_url: str) -> int:
    async def run() -> int:
        nc = await connect([nats_url], name="t")
        snapshot = await read_latest_snapshot(nc)
        await nc.close()
        return snapshot.last_seq if snapshot else 0

    return asyncio.run(run())


def test_a_late_node_catches_up_from_the_snapshot_to_exactly_a_full_replay(tmp_path, nats):
    # The history's nodes never send heartbeats: a long node timeout keeps them in State. A snapshot
    # every 1000 events may stop short of the history's end (the master folds while it is appended):
    # the one that covers it comes with the interval, 2 s here, not 30 s as by default.
    master = start_node(tmp_path, "master", nats.url, "--no-worker", "--snapshot-every", "1000",
                        "--snapshot-interval", "2", "--node-timeout", "3600")
    try:
        term = wait_until(lambda: state_of(master).leader_term, 60, what="an elected master")
        last = append_history(nats.url, 10_000, term)
        wait_until(lambda: latest_snapshot_seq(nats.url) >= 10_000, 60, what="a snapshot covering the history")
        late = start_node(tmp_path, "late", nats.url, "--no-worker", "--no-master")
        try:
            caught_up = log_line(late, r"caught up to sequence (\d+) from a snapshot at (\d+)")
            assert caught_up and int(caught_up.group(2)) >= 10_000
            late_state = state_of(late)
            assert late_state.last_seq >= last
            replayed, _ = replay(nats.url, late_state.last_seq)
            assert late_state == replayed  # field for field
            assert len(replayed.tasks) == 1200 and len(replayed.nodes) == 7  # 1000 finished kept, 200 open
        finally:
            late.interrupt()
    finally:
        master.interrupt()


def test_a_worker_that_was_down_reconciles_cards_and_fetches_images_before_it_plans(tmp_path, nats):
    model_dir = make_vision_model(tmp_path / "model")
    # The master ends a silent node's instances after EXO_SUSPECT_S: long enough here for the request
    # below to queue on the instance first, whatever the machine's load (it took 0.5 s at a load of 7
    # on 2 cores; the rest of the suspect time the test only waits).
    head, worker = start_all([
        node_process(tmp_path, "head", nats.url, "--no-worker", env={"EXO_MAX_IMAGE_BYTES": "1000000", "EXO_SUSPECT_S": "6"}),
        node_process(tmp_path, "worker", nats.url, "--no-master", "--no-api")])
    http = httpx.Client(base_url=head.url, timeout=120)
    try:
        cards = worker.data_dir / "custom_cards"
        assert http.post("/models/add", json={"model_id": "org/deleted-while-down", "n_layers": 2}).status_code == 200
        card = {"model_id": "local/vision", "path": str(model_dir), "supports_images": True}
        assert http.post("/models/add", json=card).status_code == 200
        instance = http.post("/place_instance", json={"model_id": "local/vision"}).json()["instance_id"]
        wait_until(lambda: (cards / "org--deleted-while-down.toml").exists(), 10, what="card on the worker's disk")
        wait_until(lambda: any(r.status == "ready" for r in state_of(head).runners.values()), 60, what="runner ready")
        assert worker.interrupt() == 0

        assert http.delete("/models/custom/org/deleted-while-down").status_code == 200
        assert http.post("/models/add", json={"model_id": "org/added-while-down", "n_layers": 2}).status_code == 200
        image = png(7, size=320)  # ~300 kB: more than one object-store chunk
        digest = hashlib.sha256(image).hexdigest()
        messages = [{"role": "user", "content": [
            {"type": "text", "text": "What is in this picture?"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(image).decode()}},
        ]}]
        too_big = "data:image/png;base64," + base64.b64encode(os.urandom(1_200_000)).decode()
        small = "data:image/png;base64," + base64.b64encode(os.urandom(100)).decode()
        for model, url, status in [("local/vision", too_big, 413), ("org/added-while-down", small, 400)]:
            part = {"type": "image_url", "image_url": {"url": url}}
            refused = http.post("/v1/chat/completions", json={"model": model, "messages": [{"role": "user", "content": [part]}]})
            assert refused.status_code == status, refused.text
            assert ("larger than the limit" if status == 413 else "does not take image inputs") in refused.text
        answer: dict = {}
        body = {"model": "local/vision", "messages": messages, "temperature": 0, "max_tokens": 12}
        chat = threading.Thread(target=lambda: answer.update(http.post("/v1/chat/completions", json=body).json()))
        chat.start()
        wait_until(lambda: any(t.status == "pending" for t in state_of(head).tasks.values()), 30, what="task queued")
        assert [t.instance_id for t in state_of(head).tasks.values() if t.status == "pending"] == [instance]
        # Self-healing ends the instance of the silent worker (EXO_SUSPECT_S) and the task waits for
        # the desire's replacement: the late joiner must fetch its image before planning all the same,
        # though no task of its own needs it yet. Waiting for that here makes the order of the two
        # deterministic (a start before it is the plain case: the task is the worker's own).
        wait_until(lambda: instance not in state_of(head).instances, 30, what="the down worker's instance ended")
        assert [t.instance_id for t in state_of(head).tasks.values() if t.status == "pending"] == [""]

        worker = start_node(tmp_path, "worker", nats.url, "--no-master", "--no-api",
                            env={"EXO_LOG_LEVEL": "debug"})  # its "forwarded to runner" line is at DEBUG
        chat.join(120)
        output = worker.output()
        planning = output.index("planning starts")
        assert output.index(f"image {digest} fetched and verified") < planning
        assert planning < output.index("forwarded to runner")
        assert (worker.data_dir / "images" / digest).read_bytes() == image
        assert sorted(p.name for p in cards.iterdir()) == ["local--vision.toml", "org--added-while-down.toml"]

        seen, _ = VisionReference(model_dir, tmp_path).chat("What is in this picture?", [image], 12)
        assert "choices" in answer, answer
        assert answer["choices"][0]["message"]["content"] == seen  # mlx-vlm's answer, the image seen
        replacements = list(state_of(head).instances)
        assert replacements and instance not in replacements  # the desire's replacement served it
        assert all(http.delete(f"/instance/{i}").status_code == 200 for i in replacements)
    finally:
        http.close()
        interrupt_all([worker, head])
