"""Several choices from one request (OpenAI's `n`, completions' `best_of`; exo/runner/choices.py).

In process, on the tiny model's batch: every choice equals mlx-lm's own generation (greedy, or
sampled with `mx.random.seed(seed + i)` for choice i), the prompt is prefilled once (mlx-lm's own
count of the prompt tokens it processed), each choice's cumulative logprob is the model's, and a
choice that ends before the others has its last chunk, with its end, at once. Through the API (an
exo process): the n choices in OpenAI's shapes, whole and streamed (each choice's finish_reason
where it ends), usage with the prompt counted once, best_of keeping the likeliest candidates, and
the bounds."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.sample_utils import make_sampler

from exo.core.requests import ChatMessage, GenerationParams
from exo.core.types import SamplingDefaults
from exo.runner.batch import Batcher, batchable
from exo.runner.choices import ChoicesNotResumable
from exo.runner.chunks import ChunkMaker
from exo.runner.decoding import GenerationResult, Output, RequestRefused
from exo.runner.engine import Engine
from exo.runner.process import Runner
from exo.runner.protocol import Generate, Resume
from exo.settings.services import RunnerSettings
from tests.support.e2e import Reference, place
from tests.support.fake_hub import FakeHub
from tests.support.tiny_model import TINY_MODEL_ID, make_tiny_model

pytestmark = pytest.mark.slow  # real inference


def chat(text: str, **params) -> GenerationParams:
    return GenerationParams(messages=[ChatMessage(role="user", content=text)], **params)


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> Engine:
    engine = Engine()
    engine.load(str(make_tiny_model(tmp_path_factory.mktemp("tiny") / "model")))
    return engine


Outputs = dict[int, list[Output]]


def choices_of(engine: Engine, params: GenerationParams, batcher: Batcher | None = None) -> tuple[Outputs, GenerationResult]:
    """One request through a Batcher: its outputs by choice, and its result."""
    async def run() -> tuple[Outputs, GenerationResult]:
        outs: Outputs = {}
        used = batcher or Batcher(engine, 8, ThreadPoolExecutor(max_workers=1))
        done = await used.run(asyncio.get_running_loop(), params, SamplingDefaults(),
                              lambda o: outs.setdefault(o.choice, []).append(o), lambda: False, "t")
        return outs, done

    return asyncio.run(run())


def text(outs: list[Output]) -> str:
    return "".join(o.text for o in outs)


def test_greedy_choices_are_each_mlx_lms_greedy_text(engine):
    params = chat("Tell me about the sea.", max_tokens=30, temperature=0, n=3)
    outs, done = choices_of(engine, params)
    greedy = mlx_lm.generate(engine.model, engine.tokenizer, engine.prompt_for(params), max_tokens=30)
    assert sorted(outs) == [0, 1, 2] and [text(outs[i]) for i in range(3)] == [greedy] * 3
    prompt = len(engine.encode(engine.prompt_for(params)))
    assert (done.finish_reason, done.prompt_tokens, done.completion_tokens) == ("length", prompt, 90)
    assert [(c.choice, c.finish_reason, c.completion_tokens) for c in done.choices] == [(i, "length", 30) for i in range(3)]


def test_seeded_choice_i_is_mlx_lms_generation_with_seed_plus_i(engine):
    params = chat("Once upon a time", max_tokens=24, temperature=1.2, top_p=0.95, seed=41, n=3)
    outs, done = choices_of(engine, params)
    texts = [text(outs[i]) for i in range(3)]
    for i in range(3):
        mx.random.seed(41 + i)
        sampler = make_sampler(temp=1.2, top_p=0.95)
        assert texts[i] == mlx_lm.generate(engine.model, engine.tokenizer, engine.prompt_for(params), max_tokens=24,
                                           sampler=sampler)
    assert len(set(texts)) == 3  # sampled apart: a test of the seeds, not of one text thrice
    assert done.completion_tokens == 72


def test_the_prompt_is_prefilled_once_for_every_choice(engine):
    params = chat("A prompt of its own, long enough to count: " + "the sea and the sky " * 20, max_tokens=5,
                  temperature=0, n=4)
    batcher = Batcher(engine, 8, ThreadPoolExecutor(max_workers=1))
    generator = batcher._batch()  # the one it runs the request in: mlx-lm counts the prompt tokens it processes
    with generator.stats() as stats:
        outs, done = choices_of(engine, params, batcher)
    prompt = len(engine.encode(engine.prompt_for(params)))
    assert prompt > 100 and sorted(outs) == [0, 1, 2, 3]
    # Once, after what the prompt cache held (the template's start); each row's last token is its first decode step.
    assert done.cached_tokens < 20 and stats.prompt_tokens == prompt - 1 - done.cached_tokens
    with generator.stats() as again:  # now from the prompt cache: nothing to prefill, and the same texts
        outs_again, _ = choices_of(engine, params, batcher)
    assert again.prompt_tokens == 0 and {i: text(o) for i, o in outs_again.items()} == {i: text(o) for i, o in outs.items()}


def cumulative_logprob(engine: Engine, prompt: list[int], generated: list[int]) -> float:
    """mlx-lm's model directly: the sum of log softmax over the prompt and the generated tokens."""
    logits = engine.model(mx.array(prompt + generated)[None])[0, len(prompt) - 1:-1].astype(mx.float32)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    return sum(logprobs[i, token].item() for i, token in enumerate(generated))


def test_each_candidates_logprob_is_the_models_when_best_of_ranks_them(engine):
    params = chat("Hello", max_tokens=12, temperature=1.0, seed=5, n=1, best_of=4)
    outs, done = choices_of(engine, params)
    prompt = engine.encode(engine.prompt_for(params))
    for end in done.choices:
        tokens = [t for o in outs[end.choice] for t in o.tokens]
        assert len(tokens) == 12 and end.logprob == pytest.approx(cumulative_logprob(engine, prompt, tokens), abs=1e-3)
    assert len({end.logprob for end in done.choices}) == 4


def sampled_steps(model, tokenizer, prompt: str, choices: int, max_tokens: int, seed: int, **sampling) -> list[list[str]]:
    """mlx-lm's text per token of each choice, choice i sampled after `mx.random.seed(seed + i)`."""
    steps = []
    for i in range(choices):
        mx.random.seed(seed + i)
        steps.append([r.text for r in mlx_lm.stream_generate(model, tokenizer, prompt, max_tokens=max_tokens,
                                                              sampler=make_sampler(**sampling))])
    return steps


def tokens_to(steps: list[str], stop: str) -> int | None:
    """After how many tokens the text holds `stop` (the token that completes it ends the choice)."""
    text = ""
    for count, piece in enumerate(steps, 1):
        text += piece
        if stop in text:
            return count
    return None


def unique_stop(steps: list[list[str]], choice: int, after: int) -> tuple[str, int]:
    """The first 3 characters of the choice's text, completed after token `after`, that no other
    choice's text has: a stop string that ends this choice only; and its tokens then."""
    whole, others = "".join(steps[choice]), ["".join(s) for i, s in enumerate(steps) if i != choice]
    for start in range(len(whole) - 2):
        stop = whole[start:start + 3]
        end = tokens_to(steps[choice], stop) or 0
        if end > after and not any(stop in other for other in others):
            return stop, end
    raise AssertionError(f"no stop string ends choice {choice} alone")


def stops_ending_apart(steps: list[list[str]]) -> tuple[list[str], list[int]]:
    """Stop strings that end the last choice first, the one before it next, and choice 0 at max_tokens;
    and each choice's tokens, where mlx-lm's text says it ends."""
    ends, stops, after = [len(steps[0])] * len(steps), [], 1
    for choice in range(len(steps) - 1, 0, -1):
        stop, after = unique_stop(steps, choice, after)
        stops.append(stop)
        ends[choice] = after
    assert len(set(ends)) == len(ends), ends  # choice 1 ends before max_tokens too
    return stops, ends


def cut(steps: list[str], stops: list[str]) -> str:
    """The text before the first stop string, as mlx_lm.server ends it."""
    whole = "".join(steps)
    return whole[:min([whole.index(s) for s in stops if s in whole], default=len(whole))]


def test_a_choice_that_ends_first_has_its_last_chunk_with_its_end_at_once(engine):
    params = chat("Once upon a time", max_tokens=24, temperature=1.2, top_p=0.95, seed=41, n=3)
    steps = sampled_steps(engine.model, engine.tokenizer, engine.prompt_for(params), 3, 24, 41, temp=1.2, top_p=0.95)
    stops, ends = stops_ending_apart(steps)
    params = chat("Once upon a time", max_tokens=24, temperature=1.2, top_p=0.95, seed=41, n=3, stop=stops)
    chunks, sent = ChunkMaker("t", interval_s=0.0), []  # every output a chunk: where each one lands shows

    async def run() -> GenerationResult:
        batcher = Batcher(engine, 8, ThreadPoolExecutor(max_workers=1))
        return await batcher.run(asyncio.get_running_loop(), params, SamplingDefaults(),
                                 lambda out: sent.extend(chunks.add(out, 0.0)), lambda: False, "t")

    done = asyncio.run(run())
    sent += chunks.rest(done, 0.0)
    assert ["".join(c.text for c in sent if c.choice == i) for i in range(3)] == [cut(s, stops) for s in steps]
    reasons = ["length", "stop", "stop"]
    assert [(e.finish_reason, e.completion_tokens) for e in done.choices] == list(zip(reasons, ends, strict=True))
    told = [(n, c) for n, c in enumerate(sent) if c.choices]
    assert [(c.choice, [(e.choice, e.finish_reason, e.completion_tokens) for e in c.choices]) for _, c in told] == [
        (2, [(2, "stop", ends[2])]), (1, [(1, "stop", ends[1])])]  # the last choice ended first
    for at, chunk in told:  # its own last chunk, and the others' text goes on after it
        assert chunk is [c for c in sent if c.choice == chunk.choice][-1]
        assert any(c.choice == 0 and c.text for c in sent[at + 1:])
    assert [(e.choice, e.finish_reason) for e in chunks.untold(done.choices)] == [(0, "length")]  # the final chunk's


def test_several_choices_take_the_batch_only_where_one_row_can_fan_out():
    assert batchable(chat("x", n=3), {}, multi_node=False)
    assert batchable(chat("x", n=3, seed=1), {}, multi_node=False)
    assert not batchable(chat("x", n=3), {}, multi_node=True)
    assert not batchable(chat("x", best_of=2), {}, multi_node=True)
    assert batchable(chat("x"), {}, multi_node=True)


# Through the API: an exo process serving the tiny model (its batch is on: EXO_MAX_BATCH's default).

MESSAGES = [{"role": "user", "content": "Tell me about the sea."}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("api") / "tiny")


@pytest.fixture(scope="module")
def hub(model_dir):
    with FakeHub({TINY_MODEL_ID: model_dir}) as fake:
        yield fake


@pytest.fixture(scope="module")
def tiny(http, model_dir) -> Reference:
    place(http, TINY_MODEL_ID)
    return Reference(model_dir)


def test_greedy_chat_choices_are_mlx_lms_text_and_usage_counts_the_prompt_once(client, tiny):
    reply = client.chat.completions.create(model=TINY_MODEL_ID, messages=MESSAGES, temperature=0, max_tokens=20, n=3,
                                           logprobs=True)
    greedy = tiny.chat(MESSAGES, 20)
    assert [(c.index, c.message.content, c.finish_reason) for c in reply.choices] == [(i, greedy, "length") for i in range(3)]
    assert [len(c.logprobs.content) for c in reply.choices] == [20, 20, 20]
    assert "".join(e.token for e in reply.choices[2].logprobs.content) == greedy
    prompt = tiny.prompt_tokens(tiny.chat_prompt(MESSAGES))
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens, reply.usage.total_tokens) == (prompt, 60, prompt + 60)


def test_seeded_chat_choices_streamed_and_whole_are_mlx_lms_with_seed_plus_i(client, tiny):
    sampling = {"temperature": 1.3, "top_p": 0.95, "seed": 11}
    expected = [tiny.sampled_chat(MESSAGES, 16, seed=11 + i, temperature=1.3, top_p=0.95) for i in range(3)]
    assert len(set(expected)) == 3
    whole = client.chat.completions.create(model=TINY_MODEL_ID, messages=MESSAGES, max_tokens=16, n=3, **sampling)
    assert [c.message.content for c in whole.choices] == expected
    stream = client.chat.completions.create(model=TINY_MODEL_ID, messages=MESSAGES, max_tokens=16, n=3, stream=True,
                                            stream_options={"include_usage": True}, **sampling)
    texts, roles, finishes, usage = {}, {}, {}, None
    for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:  # OpenAI's shape: one choice per event, its index says which
            roles[choice.index] = choice.delta.role or roles.get(choice.index)
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            finishes[choice.index] = choice.finish_reason or finishes.get(choice.index)
    assert [texts[i] for i in range(3)] == expected and len(texts) == 3
    assert roles == {i: "assistant" for i in range(3)} and finishes == {i: "length" for i in range(3)}
    assert (usage.prompt_tokens, usage.completion_tokens) == (tiny.prompt_tokens(tiny.chat_prompt(MESSAGES)), 48)


def finish_order(events: list[tuple[int, str, str | None]]) -> list[tuple[int, str]]:
    """The finish events of a stream of (index, text, finish_reason), in order; and that nothing of a
    choice comes after its own."""
    finishes = [(n, index, reason) for n, (index, _, reason) in enumerate(events) if reason]
    for at, index, _ in finishes:
        assert all(i != index for i, _, _ in events[at + 1:]), f"choice {index} streamed on after its finish"
    return [(index, reason) for _, index, reason in finishes]


@pytest.mark.parametrize("surface", ["chat", "completions"])
def test_each_streamed_choice_finishes_where_it_ends(client, tiny, surface):
    prompt = tiny.chat_prompt(MESSAGES) if surface == "chat" else "Once upon a time"
    steps = sampled_steps(tiny.model, tiny.tokenizer, prompt, 3, 24, 7, temp=1.2, top_p=0.95)
    stops, _ = stops_ending_apart(steps)
    sampling = {"max_tokens": 24, "n": 3, "seed": 7, "temperature": 1.2, "top_p": 0.95, "stop": stops}
    expected = [cut(s, stops) for s in steps]
    events = []
    if surface == "chat":
        for chunk in client.chat.completions.create(model=TINY_MODEL_ID, messages=MESSAGES, stream=True, **sampling):
            events += [(c.index, c.delta.content or "", c.finish_reason) for c in chunk.choices]
        whole = [(c.message.content, c.finish_reason)
                 for c in client.chat.completions.create(model=TINY_MODEL_ID, messages=MESSAGES, **sampling).choices]
    else:
        for chunk in client.completions.create(model=TINY_MODEL_ID, prompt=prompt, stream=True, **sampling):
            events += [(c.index, c.text, c.finish_reason) for c in chunk.choices]
        whole = [(c.text, c.finish_reason) for c in client.completions.create(model=TINY_MODEL_ID, prompt=prompt,
                                                                              **sampling).choices]
    assert ["".join(text for index, text, _ in events if index == i) for i in range(3)] == expected
    assert finish_order(events) == [(2, "stop"), (1, "stop"), (0, "length")]  # as they ended, not at the request's end
    assert whole == list(zip(expected, ["length", "stop", "stop"], strict=True))


def test_completions_choices_whole_and_streamed(client, tiny):
    expected = []
    for i in range(2):
        mx.random.seed(21 + i)
        expected.append(tiny.generate("Once upon a time", 12, sampler=make_sampler(temp=1.0)))
    whole = client.completions.create(model=TINY_MODEL_ID, prompt="Once upon a time", max_tokens=12, n=2, temperature=1.0,
                                      seed=21)
    assert [(c.index, c.text) for c in whole.choices] == [(0, expected[0]), (1, expected[1])]
    assert whole.usage.prompt_tokens == tiny.prompt_tokens("Once upon a time") and whole.usage.completion_tokens == 24
    texts: dict[int, str] = {}
    for chunk in client.completions.create(model=TINY_MODEL_ID, prompt="Once upon a time", max_tokens=12, n=2,
                                           temperature=1.0, seed=21, stream=True):
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
    assert texts == {0: expected[0], 1: expected[1]}


def test_best_of_returns_the_candidates_of_the_highest_cumulative_logprob(client, tiny):
    prompt, seed, best_of = "The capital of France", 3, 5
    tokens = tiny.tokenizer.encode(prompt)
    candidates = []
    for i in range(best_of):  # each candidate as mlx-lm samples it, scored by the model itself
        mx.random.seed(seed + i)
        steps = tiny.steps(prompt, 10, sampler=make_sampler(temp=1.0))
        generated = [s.token for s in steps]
        logits = tiny.model(mx.array(tokens + generated)[None])[0, len(tokens) - 1:-1].astype(mx.float32)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        score = sum(logprobs[j, t].item() for j, t in enumerate(generated))
        candidates.append((score, "".join(s.text for s in steps)))
    ranked = [text for _, text in sorted(candidates, reverse=True)]
    scores = sorted(score for score, _ in candidates)
    assert all(b - a > 1e-3 for a, b in zip(scores, scores[1:]))  # a ranking float noise cannot change
    assert ranked[:2] != [candidates[0][1], candidates[1][1]]  # not merely the first two candidates
    reply = client.completions.create(model=TINY_MODEL_ID, prompt=prompt, max_tokens=10, n=2, best_of=best_of,
                                      temperature=1.0, seed=seed)
    assert [c.text for c in reply.choices] == ranked[:2]
    assert reply.usage.completion_tokens == 10 * best_of  # every candidate was generated


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/chat/completions", {"messages": MESSAGES, "n": 17}, "n"),
    ("/v1/chat/completions", {"messages": MESSAGES, "n": 0}, "n"),
    ("/v1/completions", {"prompt": "x", "n": 17}, "n"),
    ("/v1/completions", {"prompt": "x", "n": 3, "best_of": 2}, "best_of"),
    ("/v1/completions", {"prompt": "x", "best_of": 17}, "best_of"),
    ("/v1/completions", {"prompt": "x", "n": 1, "best_of": 2, "stream": True}, "best_of"),
])
def test_choices_past_their_bounds_are_400_naming_the_field(http, tiny, path, body, param):
    response = http.post(path, json={"model": TINY_MODEL_ID, **body})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_the_single_path_refuses_several_choices_and_a_migrated_request_of_several_fails_clearly():
    async def start(runner: Runner, request: Generate) -> None:
        await runner._start(asyncio.get_running_loop(), request, lambda _: None)

    alone = Runner(None, None, RunnerSettings(max_batch=1))  # no batch: every request takes the single path
    with pytest.raises(RequestRefused, match="n > 1"):
        asyncio.run(start(alone, Generate(task_id="t", params=chat("x", n=2))))
    migrated = Generate(task_id="t", params=chat("x", best_of=3), resume=Resume(token_ids=[], next_index=0, attempt=1))
    with pytest.raises(ChoicesNotResumable, match="cannot be continued"):
        asyncio.run(start(Runner(None, None, RunnerSettings(max_batch=4)), migrated))
