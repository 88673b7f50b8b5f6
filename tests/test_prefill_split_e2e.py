"""Prefill on one instance, decode on another, through a real node: a prefill instance's runner
computes each prompt's KV cache and sends it over TCP to the decode instance's runner, which
generates from it. The text is exactly mlx-lm's, greedy and seeded, for short and long prompts;
the usage shows that the decode runner computed only the prompt's last token; and when the
prefill runner is paused or killed, the decode runner prefills alone, with the same text."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import mlx_lm
import pytest

from exo.core.ids import TaskId
from tests.support.cluster import state_of, wait_until
from tests.support.e2e import Reference, exo_serving, place
from tests.support.exo_process import ExoProcess, runner_pids
from tests.support.tiny_model import TINY_MODEL_ID, Dims, make_tiny_model

MAX_TOKENS = 12
PREFILL_TIMEOUT_S = 15.0  # 8,000 tokens take a few seconds to prefill here; a paused runner costs this much


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[ExoProcess]:
    with exo_serving(tmp_path_factory.mktemp("node"), {TINY_MODEL_ID: model_dir},
                     {"EXO_PREFILL_TIMEOUT_S": str(PREFILL_TIMEOUT_S)}) as exo:
        yield exo


@pytest.fixture(scope="module")
def http(node: ExoProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=node.url, timeout=300) as client:
        yield client


@pytest.fixture(scope="module")
def split(http: httpx.Client) -> tuple[str, str]:
    """(prefill instance, decode instance), both ready."""
    prefill = place(http, TINY_MODEL_ID, role="prefill", wait=True)
    decode = place(http, TINY_MODEL_ID, role="decode", wait=True)
    return prefill, decode


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> Reference:
    return Reference(model_dir)


def words(n: int, salt: str) -> str:
    return " ".join(f"{salt}{k % 97}" for k in range(n))


def prompt_of(reference: Reference, tokens: int, salt: str) -> str:
    """A user message whose chat prompt is about `tokens` tokens long."""
    def length(n: int) -> int:
        return reference.prompt_tokens(reference.chat_prompt([{"role": "user", "content": words(n, salt)}]))
    per_word = (length(101) - length(1)) / 100
    return words(max(1, round((tokens - length(0)) / per_word)), salt)


def chat(http: httpx.Client, content: str, **extra: object) -> tuple[str, dict, str]:
    body = {"model": TINY_MODEL_ID, "messages": [{"role": "user", "content": content}], "max_tokens": MAX_TOKENS,
            "temperature": 0, **extra}
    answer = http.post("/v1/chat/completions", json=body)
    assert answer.status_code == 200, answer.text
    reply = answer.json()
    return reply["choices"][0]["message"]["content"], reply["usage"], reply["id"].removeprefix("chatcmpl-")


def prefill_runner_pid(node: ExoProcess, prefill: str, worker: ExoProcess | None = None) -> int:
    """The runner process listening on the prefill instance's port (from `node`'s State), a child of
    `worker` (default: `node`)."""
    runner = state_of(node).runners[state_of(node).instances[prefill].shards[0].runner_id]
    port = int(runner.prefill_address.rpartition(":")[2])
    worker = worker or node
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == "0A":  # LISTEN
                inodes.add(fields[9])
    assert worker.process is not None
    for pid in runner_pids(worker.process.pid):
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            try:
                if os.readlink(fd).removeprefix("socket:[").removesuffix("]") in inodes:
                    return pid
            except OSError:
                continue
    raise AssertionError(f"no runner listens on port {port}")


@pytest.mark.parametrize("length", [25, 1000])  # 8,000: across two nodes, tests/test_prefill_split_nodes.py
def test_greedy_text_through_the_split_is_mlx_lms_and_the_decode_side_computes_one_prompt_token(
        node, http, split, reference, length):
    prefill, decode = split
    content = prompt_of(reference, length, f"g{length}x")
    text, usage, task_id = chat(http, content)
    assert abs(usage["prompt_tokens"] - length) <= max(4, length // 50), usage  # 25: the template and a word or two
    assert text == reference.chat([{"role": "user", "content": content}], MAX_TOKENS)
    task = state_of(node).tasks[TaskId(task_id)]
    assert (task.instance_id, task.prefill_instance) == (decode, prefill)
    assert usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"] - 1, usage


def test_seeded_sampling_through_the_split_is_mlx_lms(http, split, reference):
    content = words(300, "seeded")
    text, usage, _ = chat(http, content, temperature=0.8, seed=11)
    assert text == reference.sampled_chat([{"role": "user", "content": content}], MAX_TOKENS, seed=11, temperature=0.8)
    assert usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"] - 1, usage


@pytest.mark.slow
def test_a_paused_prefill_runner_costs_the_timeout_and_the_decode_side_prefills_alone(node, http, split, reference):
    prefill, _ = split
    pid = prefill_runner_pid(node, prefill)
    os.kill(pid, signal.SIGSTOP)
    try:
        content = words(200, "paused")
        text, usage, task_id = chat(http, content)
    finally:
        os.kill(pid, signal.SIGCONT)
    assert text == reference.chat([{"role": "user", "content": content}], MAX_TOKENS)
    assert usage["prompt_tokens_details"]["cached_tokens"] < usage["prompt_tokens"] - 1, usage
    logs = "".join(path.read_text(errors="replace") for path in node.data_dir.rglob("runner-*.log"))
    assert f"task {task_id}: prefilling here, not on node" in logs, logs[-3000:]


def test_a_killed_prefill_runner_is_replaced_and_meanwhile_the_decode_side_prefills_alone(node, http, split, reference):
    prefill, decode = split
    killed = prefill_runner_pid(node, prefill)
    os.kill(killed, signal.SIGKILL)
    content = words(150, "killed")
    text, usage, _ = chat(http, content)
    assert text == reference.chat([{"role": "user", "content": content}], MAX_TOKENS)

    def serving_again() -> bool:
        runner = state_of(node).runners[state_of(node).instances[prefill].shards[0].runner_id]
        try:
            return runner.status == "ready" and prefill_runner_pid(node, prefill) != killed
        except AssertionError:  # nothing listens yet
            return False
    wait_until(serving_again, 120, 0.2, what="the prefill runner to be restarted and serve again")
    content = words(150, "restarted")
    text, usage, task_id = chat(http, content)
    assert text == reference.chat([{"role": "user", "content": content}], MAX_TOKENS)
    assert usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"] - 1, usage
    assert state_of(node).tasks[TaskId(task_id)].prefill_instance == prefill


def test_a_quantized_cache_travels_quantized_and_gives_mlx_lms_quantized_text(http, tmp_path_factory):
    """kv_bits 4 on both halves: the prefill runner quantizes as the decode runner would have."""
    wide = Reference(make_tiny_model(tmp_path_factory.mktemp("wide") / "model",
                                     Dims(hidden=128, intermediate=256, heads=4, kv_heads=2)))  # head dim 32
    assert http.post("/models/add", json={"model_id": "local/q4-split", "path": str(wide.model_dir)}).status_code == 200
    for role in ("prefill", "decode"):
        placed = http.post("/place_instance", json={"model_id": "local/q4-split", "kv_bits": 4, "role": role,
                                                    "wait": True})
        assert placed.status_code == 200, placed.text
    messages = [{"role": "user", "content": prompt_of(wide, 400, "quantized")}]
    quantized = mlx_lm.generate(wide.model, wide.tokenizer, wide.chat_prompt(messages), max_tokens=MAX_TOKENS,
                                kv_bits=4, kv_group_size=32, quantized_kv_start=0)
    assert quantized != wide.generate(wide.chat_prompt(messages), MAX_TOKENS)  # 4 bits change it: the test can fail
    answer = http.post("/v1/chat/completions", json={"model": "local/q4-split", "messages": messages,
                                                     "max_tokens": MAX_TOKENS, "temperature": 0})
    assert answer.status_code == 200, answer.text
    usage = answer.json()["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"] - 1, usage
    assert answer.json()["choices"][0]["message"]["content"] == quantized


def test_a_role_is_one_of_three(http, split):
    refused = http.post("/place_instance", json={"model_id": TINY_MODEL_ID, "role": "sideways"})
    assert refused.status_code == 400 and "role" in refused.text, refused.text
    refused = http.post("/place_instance", json={"model_id": TINY_MODEL_ID, "role": "decode", "min_nodes": 2})
    assert refused.status_code == 400 and "runs on one node" in refused.text, refused.text
