"""One model across two worker processes (MLX ring group over TCP), with a head node running
the master and the API, all on one real nats-server: tensor and pipeline sharding give exactly
mlx-lm's single-process output, alone and in a batch; a killed runner fails its request at once and comes back; a
stopped worker is timed out and its model answers 503 with the reason."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.support.cluster import NatsServer, node_process, state_of, wait_until
from tests.support.e2e import Reference
from tests.support.exo_process import ExoProcess, free_port_range, interrupt_all, start_all
from tests.support.tiny_model import Dims, make_tiny_model
from tests.test_runner_lifecycle import stream_and_kill

pytestmark = pytest.mark.slow

NODE_TIMEOUT_S = 4.0
MODEL = "local/tiny4"
PROMPT = [{"role": "user", "content": "tell me about the sea"}]


def _ring_ports() -> str:
    first = free_port_range(21)
    return f"{first}-{first + 20}"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("models") / "tiny4", Dims(layers=4))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, model_dir):
    root = tmp_path_factory.mktemp("multinode")
    nats = NatsServer(root / "nats")
    beat = {"EXO_HEARTBEAT_S": "0.5", "EXO_ADVERTISE_ADDRESSES": "127.0.0.1"}
    head, *workers = start_all([
        node_process(root, "head", nats.url, "--no-worker", "--node-timeout", str(NODE_TIMEOUT_S), env=beat),
        *(node_process(root, f"worker{n}", nats.url, "--no-master", "--no-api",
                       env=beat | {"EXO_RING_PORTS": _ring_ports()}) for n in (1, 2))])
    http = httpx.Client(base_url=head.url, timeout=120)
    wait_until(lambda: len(state_of(head).nodes) == 2, 30, what="both workers registered")
    assert http.post("/models/add", json={"model_id": MODEL, "path": str(model_dir)}).status_code == 200
    yield head, workers, http
    http.close()
    left = stop_cluster(head, workers, nats)
    assert not left, f"runner processes outlived their workers: {left}"


def stop_cluster(head: ExoProcess, workers: list[ExoProcess], nats: NatsServer) -> list[int]:
    """Stop the nodes and the server; the runner processes that outlived their workers (killed now)."""
    runners = [pid for worker in workers for pid in _runner_pids(worker)]
    interrupt_all([*workers, head])
    nats.stop()
    # A stopped worker's runners go with it, even ranks blocked in a collective whose peer left
    # (two such orphans once spun at 70% CPU each after this module, until killed by hand).
    left = wait_until_gone(runners, 20)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    return left


def wait_until_gone(pids: list[int], timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    while (alive := [pid for pid in pids if Path(f"/proc/{pid}").exists()]) and time.monotonic() < deadline:
        time.sleep(0.2)
    return alive


@pytest.fixture(scope="module")
def reference(model_dir) -> Reference:
    return Reference(model_dir)


def _place(http: httpx.Client, sharding: str) -> dict:
    placed = http.post("/place_instance", json={"model_id": MODEL, "sharding": sharding, "min_nodes": 2, "wait": 120})
    assert placed.status_code == 200, placed.text
    return placed.json()


def _delete_all(http: httpx.Client, head: ExoProcess) -> None:
    for instance_id in list(state_of(head).instances):
        assert http.delete(f"/instance/{instance_id}").status_code == 200
    wait_until(lambda: not state_of(head).runners, 30, what="runners gone")


def _chat(http: httpx.Client, max_tokens: int = 24, **extra) -> httpx.Response:
    body = {"model": MODEL, "messages": PROMPT, "max_tokens": max_tokens, "temperature": 0, **extra}
    return http.post("/v1/chat/completions", json=body)


@pytest.mark.parametrize("sharding", ["tensor", "pipeline"])
def test_two_nodes_generate_exactly_what_one_process_does(cluster, reference, sharding):
    head, workers, http = cluster
    placed = _place(http, sharding)
    instance = state_of(head).instances[placed["instance_id"]]
    assert sorted(s.rank for s in instance.shards) == [0, 1]
    assert len({s.node_id for s in instance.shards}) == 2
    if sharding == "pipeline":  # equal memory on one machine: two layers each, rank 0 first
        assert [(s.start_layer, s.end_layer) for s in sorted(instance.shards, key=lambda s: s.rank)] == [(0, 2), (2, 4)]
    expected = reference.chat(PROMPT, 24)
    for _ in range(2):  # twice: the group serves one request after another
        answer = _chat(http)
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["message"]["content"] == expected
    _delete_all(http, head)


def _streamed(http: httpx.Client, ask: str, max_tokens: int) -> dict:
    """One streamed greedy chat: its text, and when its first text and its end came."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": ask}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True}
    text, first = "", None
    with http.stream("POST", "/v1/chat/completions", json=body) as stream:
        for line in stream.iter_lines():
            if line.startswith("data: {") and (delta := json.loads(line[6:])["choices"][0]["delta"].get("content")):
                first = first or time.monotonic()
                text += delta
    return {"text": text, "first": first, "done": time.monotonic()}


def test_concurrent_requests_to_two_nodes_decode_together_and_each_equals_mlx_lm(cluster, reference):
    head, workers, http = cluster
    _place(http, "pipeline")
    asks = ["tell me about the sea", "Hello", "What is the capital of France?"]
    lengths = [160, 180, 200]
    with ThreadPoolExecutor(len(asks)) as pool:
        replies = list(pool.map(lambda ask, n: _streamed(http, ask, n), asks, lengths))
    for ask, n, reply in zip(asks, lengths, replies):
        assert reply["text"] == reference.chat([{"role": "user", "content": ask}], n)
    # One after another, a request's first text would come after the one before it ended.
    assert max(r["first"] for r in replies) < min(r["done"] for r in replies)
    _delete_all(http, head)


def _runner_pids(worker: ExoProcess) -> list[int]:
    found = subprocess.run(["pgrep", "-P", str(worker.process.pid), "-f", "exo.runner"], capture_output=True, text=True)
    return [int(pid) for pid in found.stdout.split()]


def test_a_killed_runner_fails_its_request_and_the_instance_comes_back(cluster, reference):
    head, workers, http = cluster
    placed = _place(http, "pipeline")
    body = {"model": MODEL, "messages": PROMPT, "max_tokens": 5000, "temperature": 0,
            "stop": ["never-in-this-output-xyz"]}
    victim = _runner_pids(workers[1])
    assert victim, "the second worker runs a runner"
    killed = stream_and_kill(http, body, lambda: os.kill(victim[0], signal.SIGKILL))
    killed.assert_ended_by_the_kill()
    task_id = killed.task_id
    # The stream can end (the surviving rank's error chunk) before State has the failure; its task's
    # end comes after the runners' failed/stopped statuses, so from then on "ready" means ready again.
    wait_until(lambda: state_of(head).tasks[task_id].status == "failed", 30, what="the killed request failed in State")
    ready = lambda: http.get(f"/instance/{placed['instance_id']}").json().get("status") == "ready"  # noqa: E731
    wait_until(ready, 90, interval=0.5, what="instance ready again after the restart")
    answer = _chat(http)
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["message"]["content"] == reference.chat(PROMPT, 24)
    _delete_all(http, head)


def test_a_stopped_worker_is_timed_out_and_its_model_answers_503(cluster):
    head, workers, http = cluster
    _place(http, "tensor")
    workers[1].process.send_signal(signal.SIGSTOP)  # silent, like a machine that went away
    try:
        wait_until(lambda: len(state_of(head).nodes) == 1, NODE_TIMEOUT_S + 10, what="the stopped worker timed out")
        assert not state_of(head).instances
        answer = _chat(http)
        assert answer.status_code == 503, answer.text
        message = answer.json()["error"]["message"]
        assert "timed out" in message and "no heartbeat" in message, message
    finally:
        workers[1].process.send_signal(signal.SIGCONT)
    wait_until(lambda: len(state_of(head).nodes) == 2, 20, what="the worker back after SIGCONT")


def test_workers_killed_mid_generation_leave_no_runner_behind(tmp_path, model_dir):
    """Both ranks of a pipeline instance are generating when their workers die: every runner
    process ends too, though rank 0 cannot tell a follower that is gone that it leaves."""
    nats = NatsServer(tmp_path / "nats")
    beat = {"EXO_HEARTBEAT_S": "0.5", "EXO_ADVERTISE_ADDRESSES": "127.0.0.1"}
    head, *workers = start_all([
        node_process(tmp_path, "head", nats.url, "--no-worker", env=beat),
        *(node_process(tmp_path, f"worker{n}", nats.url, "--no-master", "--no-api",
                       env=beat | {"EXO_RING_PORTS": _ring_ports()}) for n in (1, 2))])
    try:
        http = httpx.Client(base_url=head.url, timeout=120)
        wait_until(lambda: len(state_of(head).nodes) == 2, 30, what="both workers registered")
        assert http.post("/models/add", json={"model_id": MODEL, "path": str(model_dir)}).status_code == 200
        _place(http, "pipeline")
        runners = [pid for worker in workers for pid in _runner_pids(worker)]
        assert len(runners) == 2
        body = {"model": MODEL, "messages": PROMPT, "max_tokens": 5000, "temperature": 0, "stream": True,
                "stop": ["never-in-this-output-xyz"]}
        with http.stream("POST", "/v1/chat/completions", json=body) as stream:
            for line in stream.iter_lines():
                if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["delta"].get("content"):
                    break
            for worker in workers:  # killed: nothing tells the runners; their stdin ends, their reports pipe breaks
                worker.process.kill()
                worker.process.wait()
        left = wait_until_gone(runners, 20)
        for pid in left:
            os.kill(pid, signal.SIGKILL)
        assert not left, f"runner processes outlived their workers: {left}"
    finally:
        interrupt_all([*workers, head])
        nats.stop()
