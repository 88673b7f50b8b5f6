"""Downloads as a user meets them: `exo` processes, the HTTP API, the local imitation of the Hub.

Two nodes on one NATS: one downloads from the Hub, the other from it through NATS with the Hub
stopped; deletion; a full restart serves again without any network. And a failed download
fails its runner, with the reason in /state and in the chat error; `--offline` fails fast.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import httpx
import pytest

from tests.support.cluster import NatsServer, node_process, state_of, wait_until
from tests.support.exo_process import ExoProcess, interrupt_all, start_all
from tests.support.fake_hub import FakeHub
from tests.support.sharded_model import make_sharded_model

pytestmark = pytest.mark.slow

REPO = "exo-test/sharded-llama"
CHAT = {"model": REPO, "messages": [{"role": "user", "content": "Hello"}], "temperature": 0, "max_tokens": 8}


def hub_env(hub: FakeHub, root: Path) -> dict[str, str]:
    return {"HF_ENDPOINT": hub.endpoint, "HF_HOME": str(root / "hf"), "HF_HUB_DISABLE_TELEMETRY": "1"}


def node_id(node: ExoProcess) -> str:
    return httpx.get(f"{node.url}/node_id", timeout=10).json()


def download(node: ExoProcess, of: str):
    return state_of(node).download_of(of, REPO)


def tree(path: Path) -> dict[str, str]:
    return {p.relative_to(path).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in path.rglob("*") if p.is_file() and not p.name.startswith(".")}


@pytest.fixture
def model(tmp_path: Path) -> Path:
    return make_sharded_model(tmp_path / "repo")


def test_a_second_node_downloads_from_the_first_through_nats_and_a_restart_needs_no_network(tmp_path, model):
    nats = NatsServer(tmp_path / "nats")
    hub = FakeHub({REPO: model})
    hub.start()
    env = hub_env(hub, tmp_path)
    first, second = start_all([node_process(tmp_path, "a", nats.url, env=env),
                               node_process(tmp_path, "b", nats.url, "--no-master", "--no-api", env=env)])
    try:
        with httpx.Client(base_url=first.url, timeout=60) as http:
            a, b = node_id(first), (second.data_dir / "node_id").read_text().strip()
            assert http.post("/models/add", json={"model_id": REPO}).status_code == 200
            assert http.post("/download/start", json={"model_id": REPO}).json()["node_id"] == a
            wait_until(lambda: (d := download(first, a)) and d.status == "completed", 30, what="download on a")
            hub.stop()
            started = http.post("/download/start", json={"model_id": REPO, "node_id": b})
            assert started.status_code == 200, started.text
            wait_until(lambda: (d := download(first, b)) and d.status == "completed", 30, what="download on b")
            record = download(first, b)
            assert record.source == f"peer:{a}" and record.done_bytes == record.total_bytes == sum(
                p.stat().st_size for p in model.iterdir())
            assert tree(Path(record.path)) == tree(model)
            assert http.post("/download/start", json={"model_id": "nobody/nothing"}).status_code == 404
            assert http.post("/download/start", json={"model_id": REPO, "node_id": "elsewhere"}).status_code == 404
            deleted = http.delete(f"/download/{b}/{REPO}")
            assert deleted.status_code == 200, deleted.text
            wait_until(lambda: download(first, b) is None, 10, what="b's download gone from State")
            assert not Path(record.path).exists()
            assert http.delete(f"/download/{b}/{REPO}").status_code == 404
            placed = http.post("/place_instance", json={"model_id": REPO})
            assert placed.status_code == 200, placed.text
            before = http.post("/v1/chat/completions", json=CHAT).json()["choices"][0]["message"]["content"]
        assert interrupt_all([second, first]) == [0, 0]
        # Everything restarts with the Hub still down: the models on disk are enough. One after the
        # other, as before the suite started nodes at once: with both at once a CI run once answered
        # this chat with an error (its body now goes into the assertion below).
        first = first.start()
        second = second.start()
        with httpx.Client(base_url=first.url, timeout=60) as http:
            answered = http.post("/v1/chat/completions", json=CHAT)
            assert answered.status_code == 200, answered.text
            after = answered.json()["choices"][0]["message"]["content"]
        assert after == before
        assert "download: " not in first.output() + second.output()  # nothing was fetched again
    finally:
        interrupt_all([first, second])
        hub.stop()
        nats.stop()


def test_a_failed_download_fails_the_runner_and_the_api_says_why(tmp_path, model):
    with FakeHub({REPO: model}) as hub:
        node = ExoProcess(tmp_path / "data", hub_env(hub, tmp_path)).start()
        try:
            with httpx.Client(base_url=node.url, timeout=60) as http:
                assert http.post("/models/add", json={"model_id": REPO}).status_code == 200
                del hub.repos[REPO]  # the repository disappears from the Hub
                placed = http.post("/place_instance", json={"model_id": REPO})
                assert placed.status_code == 200
                wait_until(lambda: [r.status for r in state_of(node).runners.values()] == ["failed"], 30,
                           what="the runner fails")
                (runner,) = state_of(node).runners.values()
                reason = f"repository not found on the Hub: {REPO}"
                assert runner.error.startswith(f"download failed: {reason}")
                record = download(node, runner.node_id)
                assert (record.status, record.error_code) == ("failed", "not_found") and record.error.startswith(reason)
                chat = http.post("/v1/chat/completions", json=CHAT)
                assert chat.status_code == 503 and reason in chat.json()["error"]["message"]  # known before it runs
                streamed = http.post("/v1/chat/completions", json=CHAT | {"stream": True})
                assert streamed.status_code == 503 and reason in streamed.json()["error"]["message"]
                report = http.get(f"/instance/{placed.json()['instance_id']}").json()
                assert report["status"] == "failed" and report["runners"][0]["failures"] == 1
        finally:
            node.interrupt()
        hub.repos[REPO] = model
        seen = len(hub.requests)
        offline = ExoProcess(tmp_path / "data", hub_env(hub, tmp_path), ["--offline"]).start()
        try:
            def offline_failure() -> str:
                runners = list(state_of(offline).runners.values())
                return runners[0].error if runners and "offline" in runners[0].error else ""
            error = wait_until(offline_failure, 30, what="the runner fails offline")
            assert f"offline mode: {REPO} is not complete in any model directory" in error
            assert hub.requests[seen:] == []  # offline: not one request to the Hub
        finally:
            offline.interrupt()
