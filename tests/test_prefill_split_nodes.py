"""Prefill on one machine, decode on another: a head node (master and API) and two workers on one
real nats-server, a prefill instance on one worker and a decode instance on the other. The KV cache
crosses between the workers' runners over TCP; the text is exactly mlx-lm's; a decode node killed
mid-generation leaves its request to the prefill instance, which finishes it exactly (a migration)."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from exo.core.ids import TaskId
from tests.support.cluster import NatsServer, node_process, state_of, wait_until
from tests.support.e2e import Reference
from tests.support.exo_process import ExoProcess, start_all
from tests.support.healing import node_id_of
from tests.support.tiny_model import make_tiny_model
from tests.test_multinode import stop_cluster
from tests.test_prefill_split_e2e import prompt_of

pytestmark = pytest.mark.slow

NODE_TIMEOUT_S = 4.0
MODEL = "local/tiny"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("models") / "tiny")


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> Reference:
    return Reference(model_dir)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory,
            model_dir: Path) -> Iterator[tuple[ExoProcess, list[ExoProcess], httpx.Client]]:
    root = tmp_path_factory.mktemp("split")
    nats = NatsServer(root / "nats")
    beat = {"EXO_HEARTBEAT_S": "0.5", "EXO_ADVERTISE_ADDRESSES": "127.0.0.1"}
    head, *workers = start_all([
        node_process(root, "head", nats.url, "--no-worker", "--node-timeout", str(NODE_TIMEOUT_S), env=beat),
        *(node_process(root, f"worker{n}", nats.url, "--no-master", "--no-api", env=beat) for n in (1, 2))])
    http = httpx.Client(base_url=head.url, timeout=300)
    wait_until(lambda: len(state_of(head).nodes) == 2, 30, what="both workers registered")
    assert http.post("/models/add", json={"model_id": MODEL, "path": str(model_dir)}).status_code == 200
    yield head, workers, http
    http.close()
    stop_cluster(head, [w for w in workers if w.process and w.process.poll() is None], nats)


def place(http: httpx.Client, role: str) -> str:
    placed = http.post("/place_instance", json={"model_id": MODEL, "role": role, "wait": 120})
    assert placed.status_code == 200, placed.text
    instance_id: str = placed.json()["instance_id"]
    return instance_id


@pytest.fixture(scope="module")
def split(cluster) -> tuple[str, str]:
    head, _, http = cluster
    prefill, decode = place(http, "prefill"), place(http, "decode")
    instances = state_of(head).instances
    assert instances[prefill].shards[0].node_id != instances[decode].shards[0].node_id, "both on one node"
    return prefill, decode


def ask(content: str, max_tokens: int, stream: bool = False) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "temperature": 0, "stream": stream}


def test_the_cache_crosses_machines_and_the_text_is_mlx_lms(cluster, split, reference):
    head, _, http = cluster
    prefill, decode = split
    content = prompt_of(reference, 1000, "across")
    answer = http.post("/v1/chat/completions", json=ask(content, 16))
    assert answer.status_code == 200, answer.text
    reply = answer.json()
    assert reply["choices"][0]["message"]["content"] == reference.chat([{"role": "user", "content": content}], 16)
    usage = reply["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"] - 1, usage
    task = state_of(head).tasks[TaskId(reply["id"].removeprefix("chatcmpl-"))]
    assert (task.instance_id, task.prefill_instance) == (decode, prefill)


def test_a_decode_node_killed_mid_generation_leaves_the_request_to_the_prefill_instance_exactly(
        cluster, split, reference):
    head, workers, http = cluster
    prefill, decode = split
    decode_node = state_of(head).instances[decode].shards[0].node_id
    victim = next(w for w in workers if node_id_of(w) == decode_node)
    content, max_tokens = prompt_of(reference, 300, "killed"), 400
    text, task_id, killed = "", "", False
    with http.stream("POST", "/v1/chat/completions", json=ask(content, max_tokens, stream=True)) as response:
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            data = json.loads(line[6:])
            assert "error" not in data, data
            task_id = task_id or data["id"].removeprefix("chatcmpl-")
            text += (data["choices"][0]["delta"].get("content") or "") if data.get("choices") else ""
            if len(text) > 20 and not killed:
                assert victim.process is not None
                os.kill(victim.process.pid, signal.SIGKILL)  # its runners exit once their worker's pipe closes
                killed = True
    assert killed, "the stream ended before the kill"
    assert text == reference.chat([{"role": "user", "content": content}], max_tokens)
    task = state_of(head).tasks[TaskId(task_id)]
    assert [m.to_instance for m in task.migrations] == [prefill], task.migrations
