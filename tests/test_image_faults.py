"""Images that cannot be had, end to end (real nats-server, real exo processes): an object in
exo-images whose bytes do not hash to its name, and one deleted before the worker fetched it,
fail their request at once with the reason, as an error status or a stream's error event; and a
worker's image folder stays within EXO_IMAGE_CACHE_BYTES without evicting what a task needs."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import json
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest

from exo.bus.connection import connect
from exo.bus.images import delete_image
from exo.bus.subjects import IMAGES_BUCKET
from tests.support.cluster import NatsServer, node_process, state_of, wait_until
from tests.support.exo_process import ExoProcess, start_all
from tests.support.images import random_png
from tests.support.tiny_model import make_tiny_model

pytestmark = pytest.mark.slow

MODEL = "local/vision-faults"
CACHE_BYTES = 300_000  # the worker's EXO_IMAGE_CACHE_BYTES: one 200 kB image fits, two do not
SOON_S = 10.0  # "at once": the failure is decided at the fetch, before any runner is involved


class Cluster:
    def __init__(self, root: Path, nats: NatsServer) -> None:
        self.root, self.nats = root, nats
        # A long node timeout: the worker is down for a moment in one test, its instance must stay.
        self.head, self.worker = start_all([
            node_process(root, "head", nats.url, "--no-worker", "--node-timeout", "3600"), self.worker_process()])
        self.http = httpx.Client(base_url=self.head.url, timeout=60)

    def start_worker(self) -> ExoProcess:
        return self.worker_process().start()

    def worker_process(self) -> ExoProcess:
        return node_process(self.root, "worker", self.nats.url, "--no-master", "--no-api",
                            env={"EXO_IMAGE_CACHE_BYTES": str(CACHE_BYTES), "EXO_LOG_LEVEL": "debug"})  # "forwarded to runner"

    @property
    def images_dir(self) -> Path:
        return self.worker.data_dir / "images"

    def runner_ready(self) -> bool:
        return any(r.status == "ready" for r in state_of(self.head).runners.values())


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    root = tmp_path_factory.mktemp("faults")
    nats = NatsServer(root / "nats")
    cluster = Cluster(root, nats)
    try:
        model_dir = make_tiny_model(root / "model")
        card = {"model_id": MODEL, "path": str(model_dir), "supports_images": True}
        assert cluster.http.post("/models/add", json=card).status_code == 200
        assert cluster.http.post("/place_instance", json={"model_id": MODEL}).status_code == 200
        wait_until(cluster.runner_ready, 90, what="runner ready")
        yield cluster
    finally:
        cluster.http.close()
        for node in (cluster.worker, cluster.head):
            if node.process is not None and node.process.poll() is None:
                with contextlib.suppress(subprocess.TimeoutExpired):  # killed then: a failed test says why
                    node.interrupt()
        nats.stop()


def body(*images: bytes, stream: bool = False) -> dict:
    parts: list[dict] = [{"type": "text", "text": "What is in this picture?"}]
    parts += [{"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(i).decode()}}
              for i in images]
    return {"model": MODEL, "messages": [{"role": "user", "content": parts}], "max_tokens": 4, "stream": stream}


def chat(http: httpx.Client, *images: bytes) -> tuple[int, dict]:
    response = http.post("/v1/chat/completions", json=body(*images))
    return response.status_code, response.json()


def chat_stream(http: httpx.Client, *images: bytes) -> tuple[int, list]:
    """The status and the stream's data lines (JSON decoded), up to and with [DONE]."""
    with http.stream("POST", "/v1/chat/completions", json=body(*images, stream=True)) as response:
        data = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
    return response.status_code, [json.loads(d) if d.startswith("{") else d for d in data]


def in_background(call, *args) -> tuple[threading.Thread, dict]:
    result: dict = {}
    thread = threading.Thread(target=lambda: result.update(answer=call(*args)), daemon=True)
    thread.start()
    return thread, result


def object_store(nats_url: str, action) -> None:
    """Run `action(nc, store)` on exo-images with a client of the test's own."""

    async def run() -> None:
        nc = await connect([nats_url], name="test-image-faults")
        try:
            await action(nc, await nc.jetstream().object_store(IMAGES_BUCKET))
        finally:
            await nc.close()

    asyncio.run(run())


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def assert_stream_failed_with(status: int, events: list, *words: str) -> None:
    assert status == 200, events
    assert events[-1] == "[DONE]", events
    errors = [e["error"] for e in events if isinstance(e, dict) and "error" in e]
    assert len(errors) == 1, events
    assert all(word in errors[0]["message"] for word in words), errors
    assert not any(e["choices"][0]["finish_reason"] for e in events if isinstance(e, dict) and e.get("choices")), events


def test_a_corrupt_image_fails_its_request_at_once_with_the_reason(cluster):
    plain, streamed = random_png(1000), random_png(1000)
    # The object store holds bytes under a name they do not hash to (same size: the API, which
    # skips an upload that is already there, leaves them as they are).
    async def corrupt(nc, store) -> None:
        for image in (plain, streamed):
            await store.put(digest(image), bytes(reversed(image)))

    object_store(cluster.nats.url, corrupt)

    started = time.monotonic()
    status, answer = chat(cluster.http, plain)
    assert time.monotonic() - started < SOON_S
    assert status == 500, answer
    assert f"image {digest(plain)}" in answer["error"]["message"] and "hash to" in answer["error"]["message"]

    started = time.monotonic()
    assert_stream_failed_with(*chat_stream(cluster.http, streamed), f"image {digest(streamed)}", "hash to")
    assert time.monotonic() - started < SOON_S
    assert not (cluster.images_dir / digest(plain)).exists() and not list(cluster.images_dir.glob(".*.tmp"))
    failed = [t for t in state_of(cluster.head).tasks.values() if t.status == "failed"]
    assert {t.error for t in failed} >= {answer["error"]["message"]}


def test_an_image_deleted_before_the_worker_fetched_it_fails_its_request_at_once(cluster):
    # A late worker: the requests are queued (their images stored) while it is down, then the
    # images expire (are deleted) before it comes back and fetches them.
    assert cluster.worker.interrupt() == 0
    plain, streamed = random_png(1000), random_png(1000)
    pending_before = sum(t.status == "pending" for t in state_of(cluster.head).tasks.values())
    chat_thread, chat_result = in_background(chat, cluster.http, plain)
    stream_thread, stream_result = in_background(chat_stream, cluster.http, streamed)
    wait_until(lambda: sum(t.status == "pending" for t in state_of(cluster.head).tasks.values()) == pending_before + 2,
               30, what="both requests queued")

    async def delete(nc, store) -> None:
        for image in (plain, streamed):
            await delete_image(nc, digest(image))

    object_store(cluster.nats.url, delete)
    cluster.worker = cluster.start_worker()
    started = time.monotonic()
    chat_thread.join(SOON_S)
    stream_thread.join(SOON_S)
    assert time.monotonic() - started < SOON_S, "the requests did not end"

    status, answer = chat_result["answer"]
    assert status == 500, answer
    assert f"image {digest(plain)} is not in the object store" in answer["error"]["message"]
    assert_stream_failed_with(*stream_result["answer"], f"image {digest(streamed)} is not in the object store")
    assert "planning starts" in cluster.worker.output()
    wait_until(cluster.runner_ready, 90, what="runner ready again")


def test_the_image_folder_stays_within_its_limit_but_keeps_what_a_task_needs(cluster):
    """Two 200 kB images of one request are over the worker's 300 kB limit: both stay until the
    task is forwarded (evicting one would fetch it again, evicting the other, for ever). The next
    request's image evicts them; a later request needing one again fetches it again."""
    first, second, third = (random_png(200_000) for _ in range(3))
    wait_until(cluster.runner_ready, 90, what="runner ready")

    def forwarded() -> int:
        return cluster.worker.output().count("forwarded to runner")

    def fetched(image: bytes) -> int:
        return cluster.worker.output().count(f"image {digest(image)} fetched and verified")

    # Whatever the runner then makes of the images (the tiny model is text-only), they reached it.
    before = forwarded()
    status, answer = chat(cluster.http, first, second)
    assert "object store" not in json.dumps(answer) and forwarded() == before + 1, (status, answer)
    assert fetched(first) == fetched(second) == 1

    status, answer = chat(cluster.http, third)
    assert forwarded() == before + 2, (status, answer)
    wait_until(lambda: {p.name for p in cluster.images_dir.iterdir()} == {digest(third)}, 10,
               what="the older images evicted")

    status, answer = chat(cluster.http, first)
    assert forwarded() == before + 3, (status, answer)
    assert fetched(first) == 2
    wait_until(lambda: {p.name for p in cluster.images_dir.iterdir()} == {digest(first)}, 10,
               what="within the limit again")
