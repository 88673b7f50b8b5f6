"""Batched decoding (exo/runner/batch.py) in process, on the tiny models: several requests in one
mlx-lm BatchGenerator send exactly what each sends alone through Engine.generate (the single
path, itself checked against mlx-lm by the API tests): the same text, token counts, logprobs,
tool calls and finish reasons, step by step; and greedy text equals mlx_lm.generate's."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.generate import BatchGenerator
from mlx_lm.sample_utils import make_sampler

from exo.core.requests import ChatMessage, GenerationParams
from exo.core.types import SamplingDefaults
from exo.runner.batch import Batcher, BatchFailed, batchable
from exo.runner.decoding import GenerationResult, Output
from exo.runner.engine import Engine
from exo.settings.declare import read
from exo.settings.services import RunnerSettings
from tests.conftest import eventually
from tests.support.tiny_model import make_tiny_model
from tests.support.tool_model import WEATHER_TOOL, make_tool_model

pytestmark = pytest.mark.slow  # real inference, though in process and in seconds

ASKS = ["Tell me about the sea.", "Hello", "Write a story about a robot who learns to paint, and keep it short & clear.",
        "What is the capital of France?", "Once upon a time", "x"]


def chat(text: str, **params) -> GenerationParams:
    return GenerationParams(messages=[ChatMessage(role="user", content=text)], **{"temperature": 0, **params})


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> Engine:
    engine = Engine()
    engine.load(str(make_tiny_model(tmp_path_factory.mktemp("tiny") / "model")))
    return engine


@pytest.fixture(scope="module")
def tool_engine(tmp_path_factory) -> Engine:
    engine = Engine()
    engine.load(str(make_tool_model(tmp_path_factory.mktemp("tools") / "model")))
    return engine


def outputs(out: list[Output]) -> list[tuple]:
    return [(o.text, o.completion_tokens, o.prompt_tokens, o.logprobs, o.tool_calls) for o in out]


def result(r: GenerationResult) -> tuple:
    return r.finish_reason, r.prompt_tokens, r.completion_tokens, r.stop_sequence


def alone(engine: Engine, params: GenerationParams, cancel_after: int | None = None) -> tuple[list, tuple]:
    out: list[Output] = []
    done = engine.generate(params, SamplingDefaults(), out.append, lambda: cancel_after is not None and len(out) >= cancel_after)
    return outputs(out), result(done)


def together_outcomes(engine: Engine, requests: list[GenerationParams]) -> list:
    async def run() -> list:
        batcher = Batcher(engine, 8, ThreadPoolExecutor(max_workers=1))
        loop = asyncio.get_running_loop()
        futures = [batcher.run(loop, p, SamplingDefaults(), lambda _: None, lambda: False, f"t{i}")
                   for i, p in enumerate(requests)]
        return await asyncio.gather(*futures, return_exceptions=True)

    return asyncio.run(run())


def together(engine: Engine, requests: list[GenerationParams], limit: int = 8, join_every: int = 0,
             cancel_after: dict[int, int] | None = None) -> list[tuple[list, tuple]]:
    """Runs the requests in one Batcher; with `join_every`, each joins that many outputs after the last."""
    cancel_after = cancel_after or {}

    async def run() -> list[tuple[list, tuple]]:
        loop = asyncio.get_running_loop()
        batcher = Batcher(engine, limit, ThreadPoolExecutor(max_workers=1))
        outs: list[list[Output]] = [[] for _ in requests]
        futures = []
        for i, params in enumerate(requests):
            if join_every and i:
                await eventually(lambda previous=outs[i - 1]: len(previous) >= join_every, 30, 0.001,
                                 what=f"request {i - 1}'s first {join_every} outputs")
            def cancelled(i: int = i) -> bool:
                return i in cancel_after and len(outs[i]) >= cancel_after[i]
            futures.append(batcher.run(loop, params, SamplingDefaults(), outs[i].append, cancelled, f"task{i}"))
        done = await asyncio.gather(*futures)
        return [(outputs(o), result(d)) for o, d in zip(outs, done)]

    return asyncio.run(run())


def test_concurrent_greedy_requests_equal_mlx_lm_and_the_single_path(engine):
    requests = [chat(ask, max_tokens=n) for ask, n in zip(ASKS, [40, 17, 64, 30, 50, 33])]
    batched = together(engine, requests)
    for params, (out, done) in zip(requests, batched):
        assert (out, done) == alone(engine, params)
        prompt = engine.prompt_for(params)
        assert "".join(o[0] for o in out) == mlx_lm.generate(engine.model, engine.tokenizer, prompt, max_tokens=params.max_tokens)
        assert done[0] == "length" and done[2] == params.max_tokens


def test_requests_that_join_a_running_batch_and_a_batch_limit_below_the_load(engine):
    requests = [chat(ask, max_tokens=n) for ask, n in zip(ASKS, [30, 45, 20, 60, 25, 35])]
    expected = [alone(engine, p) for p in requests]
    assert together(engine, requests, join_every=3) == expected
    assert together(engine, requests, limit=2) == expected


def test_stop_strings_penalties_logprobs_and_completions_in_one_batch(engine):
    plain = alone(engine, chat(ASKS[0], max_tokens=40))[0]
    text = "".join(o[0] for o in plain)
    stop = text[12:15]  # a stop string the model does write
    requests = [
        chat(ASKS[0], max_tokens=40, stop=[stop]),
        chat(ASKS[1], max_tokens=24, presence_penalty=1.5, frequency_penalty=0.5),
        chat(ASKS[2], max_tokens=12, logprobs=True, top_logprobs=3),
        GenerationParams(prompt="Once upon a time", max_tokens=20, temperature=0),
        chat(ASKS[3], max_tokens=16, logprobs=True),
    ]
    batched = together(engine, requests)
    assert batched[0][1][0] == "stop" and batched[0][1][3] == stop
    assert batched[2][0][0][3][0].top_logprobs  # logprobs came, with alternatives
    for params, got in zip(requests, batched):
        assert got == alone(engine, params)


def test_tool_calls_in_a_batch(tool_engine):
    ask = [ChatMessage(role="user", content="What is the weather in Paris?")]
    requests = [GenerationParams(messages=ask, tools=[WEATHER_TOOL], max_tokens=32, temperature=0),
                GenerationParams(messages=ask, max_tokens=16, temperature=0),
                GenerationParams(messages=ask, tools=[WEATHER_TOOL], max_tokens=32, temperature=0)]
    batched = together(tool_engine, requests)
    assert batched[0][0][-1][4][0].name == "get_weather"  # a parsed call; EOS after it ends the request
    assert batched[0][1][0] == "stop"
    for i, (params, got) in enumerate(zip(requests, batched)):
        expected = alone(tool_engine, params)
        assert got[1] == expected[1]
        assert [o[:4] for o in got[0]] == [o[:4] for o in expected[0]]
        # call ids carry the task id, which differs: compare the calls without them
        calls = [[(c.name, c.arguments) for c in o[4]] for o in got[0]]
        assert calls == [[(c.name, c.arguments) for c in o[4]] for o in expected[0]]


def test_a_cancelled_request_leaves_the_batch_at_once_and_the_others_go_on(engine):
    requests = [chat(ask, max_tokens=60) for ask in ASKS[:4]]
    batched = together(engine, requests, cancel_after={1: 5, 3: 1})
    assert batched[1][1][0] == "cancelled" and batched[1][1][2] == 5 and len(batched[1][0]) == 5
    assert batched[3][1][0] == "cancelled" and batched[3][1][2] == 1
    assert batched[1] == alone(engine, requests[1], cancel_after=5)
    for i in (0, 2):
        assert batched[i] == alone(engine, requests[i])


def test_sampled_and_seeded_requests_run_batched_and_a_seed_gives_what_mlx_lm_gives(engine):
    requests = [chat(ask, max_tokens=20, temperature=0.8, top_p=0.9) for ask in ASKS[:3]]
    seeded = [chat(ASKS[0], max_tokens=24, temperature=1.3, top_p=0.95, seed=7),
              chat(ASKS[1], max_tokens=24, temperature=0.9, top_k=5, seed=2**64 - 1)]
    outcomes = together(engine, [*requests, *seeded])
    for out, done in outcomes[:3]:
        assert done[0] == "length" and done[2] == 20 and "".join(o[0] for o in out)
    for params, (out, done) in zip(seeded, outcomes[3:]):
        # mlx-lm's own seeded generation: the global seed, then its sampler; the others in the
        # batch drew from the global random state meanwhile and change nothing.
        mx.random.seed(params.seed)
        sampler = make_sampler(temp=params.temperature, top_p=params.top_p or 0.0, top_k=params.top_k or 0)
        prompt = engine.prompt_for(params)
        reference = mlx_lm.generate(engine.model, engine.tokenizer, prompt, max_tokens=24, sampler=sampler)
        assert "".join(o[0] for o in out) == reference and done[2] == 24
        assert (out, done) == alone(engine, params)
    assert batchable(chat("x"), {}, multi_node=False)
    assert batchable(chat("x", seed=3), {}, multi_node=False)
    assert not batchable(chat("x", seed=3), {}, multi_node=True)  # the ranks agree on one sampler per setting
    assert not batchable(chat("x"), {"abc": "/tmp/image"}, multi_node=False)


def test_a_failing_request_fails_alone(engine):
    requests = [chat(ASKS[0], max_tokens=10), chat(ASKS[1], max_tokens=10)]

    def broken(output: Output) -> None:
        raise RuntimeError("cannot send")

    async def run():
        loop = asyncio.get_running_loop()
        batcher = Batcher(engine, 8, ThreadPoolExecutor(max_workers=1))
        kept: list[Output] = []
        futures = [batcher.run(loop, p, SamplingDefaults(), send, lambda: False, "t")
                   for p, send in zip(requests, [kept.append, broken])]
        return await asyncio.gather(*futures, return_exceptions=True), kept

    (good, bad), kept = asyncio.run(run())
    assert isinstance(bad, RuntimeError) and not isinstance(bad, BatchFailed)
    assert (outputs(kept), result(good)) == alone(engine, requests[0])


def test_a_failed_step_ends_every_request_in_the_batch_and_the_next_batch_starts_afresh(engine, monkeypatch):
    step = BatchGenerator.next
    calls = {"n": 0}

    def failing_third_step(self):
        calls["n"] += 1
        if calls["n"] == 3:
            raise ValueError("out of memory")
        return step(self)

    monkeypatch.setattr(BatchGenerator, "next", failing_third_step)
    ended = together_outcomes(engine, [chat(ASKS[0], max_tokens=10), chat(ASKS[1], max_tokens=10)])
    assert [str(e) for e in ended] == ["ValueError: out of memory"] * 2
    assert all(isinstance(e, BatchFailed) for e in ended)  # the runner of a multi-node instance restarts on these
    assert together(engine, [chat(ASKS[0], max_tokens=10)]) == [alone(engine, chat(ASKS[0], max_tokens=10))]


def test_the_batch_limit_comes_from_the_environment():
    assert read(RunnerSettings, {}).max_batch == 32  # as mlx_lm.server's --decode-concurrency
    assert read(RunnerSettings, {"EXO_MAX_BATCH": "1"}).max_batch == 1
    assert read(RunnerSettings, {"EXO_MAX_BATCH": "8"}).max_batch == 8


def test_a_batch_limit_of_one_keeps_every_request_on_the_single_path():
    from exo.runner.process import Runner
    from exo.runner.protocol import Generate

    request = Generate(task_id="t", params=chat("x"))
    assert not Runner(None, None, RunnerSettings(max_batch=1))._batched(request)
    assert Runner(None, None, RunnerSettings(max_batch=4))._batched(request)
