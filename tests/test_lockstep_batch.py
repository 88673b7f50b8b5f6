"""Batching inside a multi-node instance: two ranks (separate processes, an MLX ring group on
loopback) run rank 0's batch in lockstep (exo/runner/batch.py, follower.py). Requests that
join late, leave by a stop string, are cancelled, sample, or take the single path in between
all end as they would alone in one process, and nobody waits forever."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from exo.core.types import SamplingDefaults
from exo.runner.engine import Engine
from tests.support.exo_process import free_port_range
from tests.support.lockstep_ranks import params_of
from tests.support.tiny_model import Dims, make_tiny_model

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
LAYERS = 4
GREEDY = [
    {"text": "Tell me about the sea.", "max_tokens": 40},
    {"text": "Hello", "max_tokens": 55, "join_after": [0, 5]},
    {"text": "Write a story about a robot who learns to paint.", "max_tokens": 30, "presence_penalty": 0.5},
    {"text": "What is the capital of France?", "max_tokens": 48, "join_after": [2, 12]},
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("models") / "tiny4", Dims(layers=LAYERS))


@pytest.fixture(scope="module")
def sliding_model_dir(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("models") / "sliding", Dims(layers=LAYERS, sliding_window=8))


def alone_on(model_dir: Path):
    """What each request gives alone, in one process, with no prompt cache: [text, finish reason, completion tokens]."""
    engine = Engine()
    engine.load(str(model_dir))
    engine.prompt_cache.max_bytes = 0

    def run(request: dict) -> list:
        texts: list[str] = []
        done = engine.generate(params_of(request), SamplingDefaults(), lambda o: texts.append(o.text), lambda: False)
        return ["".join(texts), done.finish_reason, done.completion_tokens]

    return run


@pytest.fixture(scope="module")
def alone(model_dir):
    return alone_on(model_dir)


def on_two_ranks(model_dir: Path, sharding: str, requests: list[dict]) -> list:
    return on_two_ranks_with_cache(model_dir, sharding, requests)[0]


def on_two_ranks_with_cache(model_dir: Path, sharding: str, requests: list[dict]) -> tuple[list, list[int]]:
    """Each request's [text, finish reason, completion tokens] from rank 0, and its cached prompt tokens."""
    port = free_port_range(2)  # below the ephemeral range: port + 1 must not be some connection's local port
    hosts = json.dumps([f"127.0.0.1:{port}", f"127.0.0.1:{port + 1}"])
    layers = [(0, LAYERS // 2), (LAYERS // 2, LAYERS)]
    ranks = [
        subprocess.Popen([sys.executable, "-m", "tests.support.lockstep_ranks", str(rank), hosts, str(model_dir), sharding,
                          str(layers[rank][0]), str(layers[rank][1]), json.dumps(requests)],
                         cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for rank in (0, 1)
    ]
    try:
        outputs = [rank.communicate(timeout=180) for rank in ranks]
    finally:
        for rank in ranks:
            rank.kill()
    # Both ranks' errors: the rank that fails first is often not the one that reports it.
    assert [rank.returncode for rank in ranks] == [0, 0], "\n".join(err[-3000:] for _, err in outputs)
    lead_lines, follower_lines = (out.splitlines() for out, _ in outputs)
    assert json.loads(lead_lines[-1]) == json.loads(follower_lines[-1])  # the same tokens on both ranks
    return json.loads(lead_lines[1]), json.loads(lead_lines[0])


@pytest.mark.parametrize("sharding", ["tensor", "pipeline"])
def test_a_batch_on_two_ranks_gives_each_request_what_it_gives_alone(model_dir, alone, sharding):
    stop_word = alone(GREEDY[0])[0].split()[3]  # leaves the batch by a stop string, mid-way
    requests = [*GREEDY, {"text": GREEDY[0]["text"], "max_tokens": 40, "stop": [stop_word], "join_after": [1, 3]},
                {"text": "Hello", "max_tokens": 60, "join_after": [0, 3], "response_format": {  # rank 0 constrains
                    "type": "json_schema", "json_schema": {"type": "object", "properties": {"n": {"type": "integer",
                    "minimum": 0, "maximum": 999}, "ok": {"type": "boolean"}}, "required": ["n", "ok"],
                    "additionalProperties": False}}}]
    results = on_two_ranks(model_dir, sharding, requests)
    assert results == [alone(request) for request in requests]
    assert set(json.loads(results[-1][0])) == {"n", "ok"} and results[-1][1] == "stop"
    assert results[-1][1] == "stop" and results[-1][2] < 40


def test_cancels_sampling_and_the_single_path_in_between_keep_the_ranks_in_step(model_dir, alone):
    requests = [
        {"text": "Tell me about the sea.", "max_tokens": 60, "cancel_after": 4},
        {"text": "Hello", "max_tokens": 30, "temperature": 0.9, "top_p": 0.9},
        {"text": "Hello", "max_tokens": 25, "temperature": 0.7, "seed": 3, "join_after": [1, 2]},  # single path
        {"text": "What is the capital of France?", "max_tokens": 20, "temperature": 0.9, "join_after": [1, 4]},
        GREEDY[3] | {"join_after": [0, 4]},  # joins as the cancelled request leaves
    ]
    results = on_two_ranks(model_dir, "tensor", requests)
    assert results[0][1] == "cancelled"
    assert [r[1:] for r in results[1:4]] == [["length", 30], ["length", 25], ["length", 20]]
    assert results[2] == alone(requests[2])  # a seed repeats on two ranks what it gives on one
    assert results[4] == alone(requests[4])


def test_pipeline_ranks_that_skip_sliding_window_layers_keep_their_masks(sliding_model_dir):
    """Rank 1 skips layers 0 and 1, whose caches the model reads for its masks (sliding and full):
    they must still advance. Prompts are longer than the window; one request takes the single path."""
    alone = alone_on(sliding_model_dir)
    requests = [*GREEDY, {"text": "Hello there, tell me a story", "max_tokens": 30, "seed": 1}]
    assert on_two_ranks(sliding_model_dir, "pipeline", requests) == [alone(request) for request in requests]


SYSTEM = "You are a helpful assistant. Please answer the question, and keep it short & clear."
SEA = [["system", SYSTEM], ["user", "Tell me about the sea."]]
CONVERSATION = [  # each turn starts once the one before has ended, as a chat's turns do
    {"messages": SEA, "max_tokens": 20},
    {"messages": [*SEA, ["assistant", "The sea is deep."], ["user", "And the river?"]], "max_tokens": 20,
     "after_done": 0, "presence_penalty": 0.5},
    {"messages": [*SEA, ["assistant", "The sea is deep."], ["user", "And the river?"], ["assistant", "It flows."],
                  ["user", "Hello"]], "max_tokens": 16, "after_done": 1, "temperature": 0.9, "seed": 5},  # single path
    {"messages": [["system", SYSTEM], ["user", "What is the capital of France?"]], "max_tokens": 20, "after_done": 2},
    {"messages": SEA, "max_tokens": 20, "after_done": 3},  # the first prompt again
]


@pytest.mark.parametrize("sharding", ["tensor", "pipeline"])
def test_every_rank_reuses_the_prompt_cache_entries_rank_0_reuses(model_dir, alone, sharding):
    # A rank whose cache would reuse another prefix than rank 0's raises OutOfStep and exits non-zero.
    results, cached = on_two_ranks_with_cache(model_dir, sharding, CONVERSATION)
    assert results == [alone(request) for request in CONVERSATION]
    assert cached[0] == 0 and all(c > 10 for c in cached[1:])
