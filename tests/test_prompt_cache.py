"""The runner's prompt cache (exo/runner/prompt_cache.py): a request reuses the KV cache of the
longest cached token prefix and processes only the rest, on the single path and in the batch.

The reference is mlx-lm itself. On these CPU models a cached turn's greedy output (and its
logprobs) equals the uncached one exactly, so the in-process tests compare an engine with the
cache on to one with it off, output by output. End to end, a multi-turn session is sent to exo and
to mlx_lm.server (which caches too) on the same model and must give the same text turn by turn.
A prompt equal to a stored key (a prompt plus its generated tokens: the previous completion's
prompt and text, sent back) is mlx-lm's exact hit, which the cache trims back by one token."""

from __future__ import annotations

import asyncio
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from exo.core.requests import ChatMessage, GenerationParams
from exo.core.types import SamplingDefaults
from exo.runner.batch import Batcher
from exo.runner.decoding import GenerationResult, Output
from exo.runner.engine import Engine
from exo.runner.prompt_cache import OutOfStep, PromptCache, tokens_held
from tests.support.cluster import wait_until
from tests.support.e2e import exo_serving, place
from tests.support.tiny_model import TINY_MODEL_ID, Dims, make_tiny_model

pytestmark = pytest.mark.slow  # real inference

SYSTEM = "You are a helpful assistant. Please answer the question, and keep it short & clear. " * 3


def chat(*turns: tuple[str, str], **params) -> GenerationParams:
    return GenerationParams(messages=[ChatMessage(role=r, content=c) for r, c in turns],
                            **{"temperature": 0, "max_tokens": 24, **params})


def loaded(model_dir: Path, cache_bytes: int | None = None) -> Engine:
    engine = Engine()
    engine.load(str(model_dir))
    if cache_bytes is not None:
        engine.prompt_cache = PromptCache(engine.model, cache_bytes)
    return engine


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module")
def uncached(model_dir) -> Engine:
    return loaded(model_dir, cache_bytes=0)


def run_alone(engine: Engine, params: GenerationParams) -> tuple[list, GenerationResult]:
    out: list[Output] = []
    done = engine.generate(params, SamplingDefaults(), out.append, lambda: False)
    return [(o.text, o.completion_tokens, o.prompt_tokens, o.logprobs, o.tool_calls) for o in out], done


def run_batched(engine: Engine, requests: list[GenerationParams]) -> list[tuple[list, GenerationResult]]:
    async def run() -> list:
        batcher = Batcher(engine, 8, ThreadPoolExecutor(max_workers=1))
        loop = asyncio.get_running_loop()
        outs: list[list[Output]] = [[] for _ in requests]
        futures = [batcher.run(loop, p, SamplingDefaults(), outs[i].append, lambda: False, f"t{i}")
                   for i, p in enumerate(requests)]
        results = await asyncio.gather(*futures)
        return [([(o.text, o.completion_tokens, o.prompt_tokens, o.logprobs, o.tool_calls) for o in out], r)
                for out, r in zip(outs, results)]

    return asyncio.run(run())


def text_of(outputs: list) -> str:
    return "".join(o[0] for o in outputs)


def test_a_growing_conversation_reuses_each_turn_and_equals_the_uncached_output(model_dir, uncached):
    engine = loaded(model_dir)
    turns: list[tuple[str, str]] = [("system", SYSTEM), ("user", "Tell me about the sea.")]
    previous_prompt = 0
    for turn, extra in enumerate([{}, {"logprobs": True, "top_logprobs": 3}, {"presence_penalty": 0.8},
                                  {"stop": ["the"]}, {"temperature": 0.9, "seed": 11}]):
        params = chat(*turns, **extra)
        got, done = run_alone(engine, params)
        want, reference = run_alone(uncached, params)
        assert got == want, f"turn {turn} ({extra})"
        assert (done.finish_reason, done.prompt_tokens, done.completion_tokens) == (
            reference.finish_reason, reference.prompt_tokens, reference.completion_tokens)
        assert reference.cached_tokens == 0
        # Turn 1 has nothing cached; later turns reuse at least the whole previous prompt.
        assert done.cached_tokens == 0 if turn == 0 else done.cached_tokens >= previous_prompt
        previous_prompt = done.prompt_tokens
        turns += [("assistant", text_of(got)), ("user", f"And then, part {turn}?")]
    stats = engine.prompt_cache.stats()
    assert (stats.hits, stats.misses, stats.entries) == (4, 1, 1)  # a longer entry replaces its prefix
    assert stats.tokens_reused > 4 * len(SYSTEM) // 8 and stats.bytes > 0


def completion(prompt: str) -> GenerationParams:
    return GenerationParams(prompt=prompt, temperature=0, max_tokens=12, logprobs=True, top_logprobs=2)


def generated_ids(engine: Engine, params: GenerationParams) -> tuple[str, list[int]]:
    out: list[Output] = []
    engine.generate(params, SamplingDefaults(), out.append, lambda: False)
    return "".join(o.text for o in out), [t for o in out for t in o.tokens]


def test_a_prompt_equal_to_a_stored_key_is_trimmed_back_by_one_token_and_equals_the_uncached_output(
        model_dir, uncached):
    # A stored key is a prompt plus its generated tokens, so only a prompt that repeats both is an
    # exact hit: mlx-lm hands back the entry with nothing left to process, and the cache trims it
    # back by one token so the model computes the first logits from the last one again.
    engine = loaded(model_dir)
    cache = engine.prompt_cache
    prompt = "Write a story about a robot"
    text, ids = generated_ids(engine, completion(prompt))
    for path, run in (("alone", lambda p: run_alone(engine, p)), ("batched", lambda p: run_batched(engine, [p])[0])):
        key = engine.encode(prompt) + ids  # what the last request stored
        prompt += text
        assert engine.encode(prompt) == key, path  # the completion's text re-encodes to its tokens
        assert cache.stats().entries == 1  # a longer entry replaced its prefix: the key is the only one
        assert cache._lru.fetch_nearest_cache("", key)[1] == [], path  # mlx-lm: an exact hit, no rest
        reuse = cache.take(key, scope="")
        assert (reuse.rest, reuse.cached, tokens_held(reuse.cache)) == (key[-1:], len(key) - 1, len(key) - 1), path
        hits = cache.stats().hits
        got, done = run(completion(prompt))
        want, reference = run_alone(uncached, completion(prompt))
        assert got == want, path  # text, logprobs and counts, output by output
        assert (done.finish_reason, done.prompt_tokens, done.completion_tokens) == (
            reference.finish_reason, reference.prompt_tokens, reference.completion_tokens)
        assert (done.prompt_tokens, done.cached_tokens, cache.stats().hits) == (len(key), len(key) - 1, hits + 1), path
        text, ids = text_of(got), generated_ids(uncached, completion(prompt))[1]  # (equal to got: asserted above)


def test_penalties_see_the_cached_prompt_tokens_as_they_see_uncached_ones(model_dir, uncached):
    # The same prompt twice: the second processes one token, but its penalties look back 20 tokens.
    engine = loaded(model_dir)
    params = chat(("user", "Tell me about the sea."), presence_penalty=1.5, frequency_penalty=1.0, max_tokens=12,
                  logprobs=True, top_logprobs=2)  # the penalised logits show in the logprobs
    for _ in range(2):
        got, done = run_alone(engine, params)
        assert got == run_alone(uncached, params)[0]
    assert done.cached_tokens == done.prompt_tokens - 1


def test_batched_requests_reuse_and_store_caches_and_equal_the_uncached_output(model_dir, uncached):
    engine = loaded(model_dir)
    first = chat(("system", SYSTEM), ("user", "Tell me about the sea."))
    run_alone(engine, first)  # cached on the single path, reused in the batch
    branch = chat(("system", SYSTEM), ("user", "What is the capital of France?"), presence_penalty=0.5)
    strict_prefix = chat(("system", SYSTEM))  # its prompt is a prefix of the cached one
    again = chat(("system", SYSTEM), ("user", "Tell me about the sea."), logprobs=True, top_logprobs=2)
    other = chat(("user", "Hello"), stop=["a"])
    requests = [branch, strict_prefix, again, other]
    got = run_batched(engine, requests)
    for params, (outputs, done) in zip(requests, got):
        want, reference = run_alone(uncached, params)
        assert outputs == want
        assert (done.finish_reason, done.prompt_tokens, done.completion_tokens) == (
            reference.finish_reason, reference.prompt_tokens, reference.completion_tokens)
    cached = [done.cached_tokens for _, done in got]
    assert all(c > len(SYSTEM) // 8 for c in cached[:3])  # the system prompt (and more) came from the cache
    assert cached[2] == got[2][1].prompt_tokens - 1  # the same prompt again: all but its last token
    # The batch stored what it generated: the next turn of `branch` reuses its whole prompt.
    follow_up = chat(("system", SYSTEM), ("user", "What is the capital of France?"),
                     ("assistant", text_of(got[0][0])), ("user", "Why?"), presence_penalty=0.5)
    (outputs, done), = run_batched(engine, [follow_up])
    assert outputs == run_alone(uncached, follow_up)[0]
    assert done.cached_tokens >= got[0][1].prompt_tokens


def test_the_byte_and_entry_limits_evict_the_oldest_and_are_counted(model_dir, uncached):
    engine = loaded(model_dir)
    asks = ["Hello", "What is the capital of France?", "Once upon a time", "Tell me a joke."]  # no shared words
    for ask in asks:
        run_alone(engine, chat(("user", ask)))
    one_entry = engine.prompt_cache.stats().bytes // len(asks)
    engine.prompt_cache.max_bytes = 2 * one_entry + one_entry // 2
    engine.prompt_cache.trim()
    stats = engine.prompt_cache.stats()
    assert (stats.entries, stats.evictions) == (2, 2) and stats.bytes <= engine.prompt_cache.max_bytes
    # The oldest went: the first ask is a miss now (only the shared template start is reused)...
    _, done = run_alone(engine, chat(("user", asks[0])))
    assert done.cached_tokens < 8
    # ...and the newest is still there.
    _, done = run_alone(engine, chat(("user", asks[-1])))
    assert done.cached_tokens == done.prompt_tokens - 1
    engine.prompt_cache.max_entries = 1
    engine.prompt_cache.trim()
    assert engine.prompt_cache.stats().entries == 1


def test_turned_off_it_holds_nothing(model_dir, uncached):
    for _ in range(2):
        _, done = run_alone(uncached, chat(("user", "Hello")))
        assert done.cached_tokens == 0
    assert uncached.prompt_cache.stats().entries == 0 and uncached.prompt_cache.stats().hits == 0


def test_a_rank_whose_cache_would_reuse_another_prefix_is_out_of_step(model_dir):
    engine = loaded(model_dir)
    tokens = engine.encode(engine.prompt_for(chat(("user", "Hello"))))
    run_alone(engine, chat(("user", "Hello")))
    assert engine.prompt_cache.take(tokens, scope="", expect=len(tokens) - 1).cached == len(tokens) - 1
    with pytest.raises(OutOfStep):
        engine.prompt_cache.take(tokens, scope="", expect=0)


def test_sliding_window_caches_that_cannot_be_trimmed_are_reused_only_where_correct(tmp_path):
    model_dir = make_tiny_model(tmp_path / "sliding", Dims(sliding_window=8))
    engine, uncached = loaded(model_dir), loaded(model_dir, cache_bytes=0)
    turns: list[tuple[str, str]] = [("user", "Tell me about the sea.")]
    for turn in range(3):
        params = chat(*turns)
        got, _ = run_alone(engine, params)
        assert got == run_alone(uncached, params)[0], f"turn {turn}"
        # The same prompt again: its window cache cannot be trimmed back by one token, so no reuse
        # of the whole entry; the output is still right.
        assert run_batched(engine, [params])[0][0] == got
        turns += [("assistant", text_of(got)), ("user", "More?")]
    assert engine.prompt_cache.stats().hits > 0  # a turn extends the last one's cache, which needs no trim


def test_generation_stops_at_the_models_context_and_a_prompt_that_fills_it_is_refused(model_dir):
    # Not a cache property, but these helpers run both paths: max_tokens is capped by what the
    # context leaves after the prompt, and a prompt as long as the context is an error, not a run.
    from exo.runner.decoding import PromptTooLong

    engine = loaded(model_dir, cache_bytes=0)
    params = chat(("user", "Hello"), max_tokens=500)
    prompt = len(engine.encode(engine.prompt_for(params)))
    engine.context_length = prompt + 7
    _, alone = run_alone(engine, params)
    [(_, batched)] = run_batched(engine, [params])
    assert [(r.finish_reason, r.completion_tokens) for r in (alone, batched)] == [("length", 7)] * 2
    engine.context_length = prompt
    with pytest.raises(PromptTooLong, match=f"the prompt is {prompt} tokens; this instance's context is {prompt}"):
        run_alone(engine, params)
    with pytest.raises(PromptTooLong):
        run_batched(engine, [params])


# End to end: exo and mlx_lm.server, the same turns, the same text.

@pytest.fixture(scope="module")
def node(tmp_path_factory, model_dir):
    with exo_serving(tmp_path_factory.mktemp("node"), {TINY_MODEL_ID: model_dir}) as exo:
        yield exo


@pytest.fixture(scope="module")
def mlx_lm_server(tmp_path_factory, model_dir):
    from tests.support.mlx_lm_server import start_mlx_lm_server

    server, url = start_mlx_lm_server(model_dir, tmp_path_factory.mktemp("server") / "log")
    yield url
    server.kill()
    server.wait()


def ask(client: httpx.Client, model: str, messages: list[dict], max_tokens: int = 24) -> tuple[str, dict]:
    answer = client.post("/v1/chat/completions", json={"model": model, "messages": messages, "temperature": 0,
                                                       "max_tokens": max_tokens})
    assert answer.status_code == 200, answer.text
    body = answer.json()
    return body["choices"][0]["message"]["content"], body["usage"]


def test_multi_turn_sessions_give_mlx_lm_servers_text_turn_by_turn(http, node, mlx_lm_server, model_dir):
    place(http, TINY_MODEL_ID)
    server = httpx.Client(base_url=mlx_lm_server, timeout=300)
    sea = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Tell me about the sea."}]
    joke = [{"role": "user", "content": "Tell me a joke."}]
    plan = [  # (conversation, what to add before asking): growing, interleaved, a branch, a strict prefix
        ("sea", []), ("joke", []), ("sea", ["Go on."]), ("joke", ["Another one."]), ("sea", ["And the river?"]),
        ("branch", []), ("prefix", []), ("sea", ["Thank you."]),
    ]
    conversations = {"sea": sea, "joke": joke}
    cached_turns = []
    for name, follow_ups in plan:
        if name == "branch":
            messages = [sea[0], {"role": "user", "content": "What is the capital of France?"}]
        elif name == "prefix":
            messages = sea[:2]
        else:
            messages = conversations[name]
            messages += [{"role": "user", "content": text} for text in follow_ups]
        ours, usage = ask(http, TINY_MODEL_ID, messages)
        theirs, _ = ask(server, str(model_dir), messages)
        assert ours == theirs, (name, follow_ups)
        cached_turns.append(usage["prompt_tokens_details"]["cached_tokens"])
        if name in conversations:
            messages.append({"role": "assistant", "content": ours})
    assert cached_turns[0] == 0 and cached_turns[1] < 8  # first turns: at most the template's shared start
    assert all(c > 20 for c in cached_turns[2:])


def complete(client: httpx.Client, model: str, prompt: str, **extra) -> dict:
    answer = client.post("/v1/completions", json={"model": model, "prompt": prompt, "temperature": 0,
                                                  "max_tokens": 12, **extra})
    assert answer.status_code == 200, answer.text
    return answer.json()


def test_a_completion_of_the_previous_prompt_and_its_completion_is_an_exact_hit(http, node, mlx_lm_server, model_dir,
                                                                                uncached):
    if not any(i["model_id"] == TINY_MODEL_ID for i in http.get("/state").json()["instances"].values()):
        place(http, TINY_MODEL_ID)
    prompt = "Write a story about a robot who learns to paint."
    first = complete(http, TINY_MODEL_ID, prompt)
    follow_up = prompt + first["choices"][0]["text"]  # re-encodes to the key the first request stored
    second = complete(http, TINY_MODEL_ID, follow_up, logprobs=2)
    usage = second["usage"]
    assert usage["prompt_tokens"] == first["usage"]["prompt_tokens"] + first["usage"]["completion_tokens"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"] - 1
    want, _ = run_alone(uncached, completion(follow_up))
    assert second["choices"][0]["text"] == text_of(want)
    assert second["choices"][0]["logprobs"]["token_logprobs"] == [lp.logprob for o in want for lp in o[3]]
    # mlx_lm.server's own exact hit kills its generation thread ("Sequence 1 has an empty prompt"):
    # it is asked the follow-up before the prompt it extends, so neither is a stored key there.
    with httpx.Client(base_url=mlx_lm_server, timeout=300) as server:
        for asked, ours in ((follow_up, second), (prompt, first)):
            assert complete(server, str(model_dir), asked)["choices"][0]["text"] == ours["choices"][0]["text"]


def test_with_two_instances_each_conversation_stays_where_its_cache_is(http, node):
    while len([i for i in http.get("/state").json()["instances"].values() if i["model_id"] == TINY_MODEL_ID]) < 2:
        place(http, TINY_MODEL_ID)
    histories = {c: [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Task {c}: {ask_}"}]
                 for c, ask_ in enumerate(["Tell me about the sea.", "Hello", "Tell me a joke.", "Once upon a time"])}
    served: dict[int, list[tuple[str, int]]] = {c: [] for c in histories}

    def turn_of(conversation: int, turn: int) -> None:
        answer = http_turn.post("/v1/chat/completions", json={"model": TINY_MODEL_ID, "temperature": 0, "max_tokens": 48,
                                                                "messages": histories[conversation]})
        assert answer.status_code == 200, answer.text
        body = answer.json()
        task = http_turn.get("/state").json()["tasks"][body["id"].removeprefix("chatcmpl-")]
        served[conversation].append((task["instance_id"], body["usage"]["prompt_tokens_details"]["cached_tokens"]))
        histories[conversation] += [{"role": "assistant", "content": body["choices"][0]["message"]["content"]},
                                    {"role": "user", "content": f"Go on ({turn})."}]

    with httpx.Client(base_url=node.url, timeout=300) as http_turn, ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda c: turn_of(c, 0), histories))  # together: the least busy instance spreads them
        for turn in (1, 2):
            for conversation in (2, 0, 3, 1) if turn == 1 else (0, 1, 2, 3):  # one at a time: every instance idle
                turn_of(conversation, turn)
    assert len({turns[0][0] for turns in served.values()}) == 2
    for conversation, turns in served.items():
        assert len({instance for instance, _ in turns}) == 1, (conversation, turns)  # every turn where the first went
        assert all(cached > len(SYSTEM) // 8 for _, cached in turns[1:]), turns  # and found its cache there
    # Each runner's figures reach /metrics with its node's next heartbeat (every 5 s): at least the
    # hits this test saw there (the split of the first turns is the router's to choose; earlier
    # tests' hits may add to one instance's count).
    seen_hits = Counter(instance for turns in served.values() for instance, cached in turns if cached > 0)

    def all_seen_hits_reported() -> bool:
        hits = {line.split('instance_id="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
                for line in http.get("/metrics").text.splitlines() if line.startswith("exo_prompt_cache_hits_total{")}
        return all(hits.get(instance, 0) >= n for instance, n in seen_hits.items())

    wait_until(all_seen_hits_reported, 15, 0.5, what=f"/metrics reporting at least the hits seen, {dict(seen_hits)}")


# Cache scopes (docs/prompt-cache.md, "What one key can learn"): a request reuses only entries of
# its own scope, so what another key sent never shows in its cached_tokens.

SECRET = [("system", SYSTEM), ("user", "My salary is 123,456 a year. Keep it to yourself.")]


@pytest.mark.parametrize("path", ["alone", "batched"])
def test_a_scope_reuses_only_its_own_entries_and_another_keys_guesses_get_nothing(model_dir, path):
    engine = loaded(model_dir)

    def cached(scope: str, *turns: tuple[str, str]) -> tuple[int, int]:
        params = chat(*turns, cache_scope=scope)
        _, done = run_alone(engine, params) if path == "alone" else run_batched(engine, [params])[0]
        return done.cached_tokens, done.prompt_tokens

    assert cached("key:alice", *SECRET)[0] == 0
    # Another key's exact repeat, a guess that shares all but the last words, and a keyless request
    # each get what an unrelated prompt gets in a scope of its own: nothing.
    unrelated = cached("key:dave", ("user", "Tell me a joke."))[0]
    guesses = [cached("key:bob", *SECRET)[0], cached("key:carol", SECRET[0], ("user", "My salary is 123,456 a year."))[0],
               cached("", *SECRET)[0]]
    assert guesses == [unrelated] * 3 == [0] * 3
    # Each scope keeps and reuses its own: Alice's repeat, and Bob's.
    for scope in ("key:alice", "key:bob"):
        reused, prompt = cached(scope, *SECRET)
        assert reused == prompt - 1, scope


def test_keys_of_one_cache_scope_share_their_entries_on_both_paths(model_dir):
    engine = loaded(model_dir)
    _, first = run_alone(engine, chat(*SECRET, cache_scope="scope:team"))
    _, alone = run_alone(engine, chat(*SECRET, cache_scope="scope:team"))
    [(_, batched)] = run_batched(engine, [chat(*SECRET, ("assistant", "Noted."), ("user", "Thanks"),
                                               cache_scope="scope:team")])
    assert (first.cached_tokens, alone.cached_tokens) == (0, alone.prompt_tokens - 1)
    assert batched.cached_tokens >= alone.prompt_tokens  # the whole earlier prompt, and what the team generated
    stats = engine.prompt_cache.stats()
    assert (stats.hits, stats.misses) == (2, 1)
