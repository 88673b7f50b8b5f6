"""A brief full disk under a node: while it lasts, writes are a 507 naming the cause (not a 500
after 30 s) and /health says "degraded"; when space returns the node recovers by itself within
seconds, with nothing acknowledged lost. It used to stay broken: nats-server keeps a stream whose
write failed for lack of space failing until it restarts, so every request got a 500 long after
the space was back, and /health said ok throughout.

The node's data dir is on a tmpfs mounted for the test (root only); skipped with the reason
elsewhere, required in CI (EXO_REQUIRE_MOUNT=1)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from exo.bus.connection import connect
from exo.bus.subjects import event_subject
from tests.support.cluster import wait_until
from tests.support.exo_process import ExoProcess
from tests.support.mounts import mounted_tmpfs

pytestmark = pytest.mark.slow  # an exo process


@pytest.fixture
def disk(tmp_path: Path):
    yield from mounted_tmpfs(tmp_path / "disk", "1g")


def _fill(path: Path) -> None:
    """Take every byte of the filesystem (dd stops at "no space left")."""
    subprocess.run(["dd", "if=/dev/zero", f"of={path}", "bs=1M"], capture_output=True)


async def _append_events(node: ExoProcess) -> bool:
    """Events appended with exo's credentials, as a worker does (big ones: the store buffers small
    writes), until one is not stored; False then, True if all five were."""
    nc = await connect([node.nats_url()], name="test-writer")
    try:
        for n in range(5):
            await nc.jetstream().publish(event_subject("node.heartbeat"), b" " * (256 << 10), timeout=3)
        return True
    except Exception:
        return False
    finally:
        await nc.close()


def test_a_full_disk_is_said_and_recovered_from_by_itself(disk: Path, tmp_path: Path):
    node = ExoProcess(disk / "node", {"EXO_DISCOVERY": "0"})
    node.log_path = tmp_path / "node-exo.log"  # the node's own output must not need the full disk
    node.start()
    try:
        with httpx.Client(base_url=node.url, timeout=60) as http:
            assert http.post("/models/add", json={"model_id": "org/before", "n_layers": 2}).status_code == 200
            filler = disk / "filler"
            _fill(filler)
            # An event that reaches the log while it is full (a worker's, say): the stream's store fails it.
            started = time.monotonic()
            assert not asyncio.run(_append_events(node))
            wait_until(lambda: http.get("/health").json()["status"] == "degraded", 10, what="health degraded")
            health = http.get("/health")
            assert health.status_code == 503 and "is full" in health.json()["problem"]
            refused = http.post("/models/add", json={"model_id": "org/refused", "n_layers": 2})
            assert refused.status_code == 507 and refused.headers["Retry-After"] == "5"
            assert "is full" in refused.json()["error"]["message"] and time.monotonic() - started < 60

            os.remove(filler)
            freed = time.monotonic()
            wait_until(lambda: http.get("/health").status_code == 200, 30, what="health ok again")
            after = wait_until(lambda: (r := http.post("/models/add", json={"model_id": "org/after", "n_layers": 2}))
                               .status_code == 200 and r, 30, what="a write accepted again")
            assert after and time.monotonic() - freed < 30
            cards = http.get("/state").json()["custom_model_cards"]
            assert {"org/before", "org/after"} <= set(cards) and "org/refused" not in cards
            assert "restarting the embedded nats-server" in node.output()
    finally:
        node.interrupt()
