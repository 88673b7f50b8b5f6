"""The sampling fields clients send beyond temperature and top_p (min_p, top_k, logit_bias,
repetition_penalty, and Ollama's min_p, repeat_penalty and repeat_last_n options) through the API,
on the single path (EXO_MAX_BATCH=1) and on the batched one: each text equals mlx-lm's own
generation with a sampler or processors built here from the same values (after mx.random.seed
for a seed), never exo's code. And each bound's 400 names its field."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.sample_utils import make_logits_processors, make_sampler

from exo.core.types import ModelCard, SamplingDefaults
from tests.support.e2e import Reference, exo_serving, place
from tests.support.tiny_model import TINY_MODEL_ID, make_tiny_model

pytestmark = pytest.mark.slow

MESSAGES = [{"role": "user", "content": "Tell me about the sea."}]
SEED = 11
EVERY_TOKEN = 2**31 - 1  # a repetition context longer than any request: all its tokens


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("model") / "tiny")


@pytest.fixture(scope="module", params=["single", "batched"])
def node(request, tmp_path_factory, model_dir):
    # EXO_MAX_BATCH=1 turns the batch off: every request runs alone (Engine.generate).
    limit = "1" if request.param == "single" else "8"
    with exo_serving(tmp_path_factory.mktemp(request.param), {TINY_MODEL_ID: model_dir}, {"EXO_MAX_BATCH": limit}) as exo:
        yield exo


@pytest.fixture(scope="module")
def reference(model_dir) -> Reference:
    return Reference(model_dir)


@pytest.fixture(scope="module")
def tiny(http, reference) -> Reference:
    place(http, TINY_MODEL_ID)
    return reference


def seeded(tiny: Reference, max_tokens: int, **sampler: Any) -> str:
    """mlx-lm's seeded sampling: the global seed, then make_sampler with these values."""
    mx.random.seed(SEED)
    return tiny.chat(MESSAGES, max_tokens, sampler=make_sampler(**sampler))


def processed(tiny: Reference, max_tokens: int, **processors: Any) -> str:
    """mlx-lm's greedy text with make_logits_processors(**processors)."""
    return tiny.chat(MESSAGES, max_tokens, logits_processors=make_logits_processors(**processors))


def chat(client, max_tokens: int, **fields: Any) -> str:
    """One chat completion; fields OpenAI's SDK has no argument for go in the body as they are."""
    known = {k: fields.pop(k) for k in ("temperature", "top_p", "seed", "logit_bias") if k in fields}
    reply = client.chat.completions.create(model=TINY_MODEL_ID, messages=MESSAGES, max_tokens=max_tokens,
                                           extra_body=fields, **known)
    text: str = reply.choices[0].message.content
    return text


def test_min_p_and_top_k_with_a_seed_equal_mlx_lms_sampler(client, tiny):
    plain = seeded(tiny, 24, temp=1.5)
    min_p = seeded(tiny, 24, temp=1.5, min_p=0.2)
    assert min_p != plain  # min_p changes this text: the test can fail
    assert chat(client, 24, temperature=1.5, seed=SEED, min_p=0.2) == min_p
    assert chat(client, 24, temperature=1.5, seed=SEED, top_k=3) == seeded(tiny, 24, temp=1.5, top_k=3) != plain
    # All three filters in one request, applied in make_sampler's order.
    assert chat(client, 24, temperature=1.2, top_p=0.95, seed=SEED, min_p=0.1, top_k=8) == seeded(
        tiny, 24, temp=1.2, top_p=0.95, min_p=0.1, top_k=8)
    # vLLM's -1 is off, and so is a top_k of the whole vocabulary (every token kept; mlx-lm refuses it).
    assert chat(client, 24, temperature=1.5, seed=SEED, top_k=-1) == plain
    assert chat(client, 24, temperature=1.5, seed=SEED, top_k=tiny.model.args.vocab_size) == plain


def test_repetition_penalty_equals_mlx_lms_processor_on_chat_and_completions(client, tiny):
    penalised = processed(tiny, 32, repetition_penalty=1.5)
    assert penalised != tiny.chat(MESSAGES, 32)  # the penalty changes this text: the test can fail
    assert chat(client, 32, temperature=0, repetition_penalty=1.5) == penalised
    prompt = "Once upon a time"
    completion = client.completions.create(model=TINY_MODEL_ID, prompt=prompt, max_tokens=32, temperature=0,
                                           extra_body={"repetition_penalty": 1.5})
    assert completion.choices[0].text == tiny.generate(
        prompt, 32, logits_processors=make_logits_processors(repetition_penalty=1.5))


def test_a_logit_bias_of_100_gives_its_token_at_every_step(client, tiny):
    sea = tiny.tokenizer.encode(" sea", add_special_tokens=False)[0]  # a token of ordinary text
    steps = tiny.steps(tiny.chat_prompt(MESSAGES), 8, logits_processors=make_logits_processors(logit_bias={sea: 100}))
    assert [s.token for s in steps] == [sea] * 8
    assert chat(client, 8, temperature=0, logit_bias={str(sea): 100}) == "".join(s.text for s in steps)
    # A bias against the greedy first token: the text goes another way, as mlx-lm's does.
    first = tiny.steps(tiny.chat_prompt(MESSAGES), 1)[0].token
    avoided = processed(tiny, 16, logit_bias={first: -100})
    assert avoided != tiny.chat(MESSAGES, 16)
    assert chat(client, 16, temperature=0, logit_bias={str(first): -100}) == avoided
    completion = client.completions.create(model=TINY_MODEL_ID, prompt="Once upon a time", max_tokens=6, temperature=0,
                                           logit_bias={str(sea): 100})
    assert completion.choices[0].text == tiny.tokenizer.decode([sea] * 6)


def test_concurrent_requests_keep_their_own_processors(client, tiny):
    """On the batched path these decode together: each row's processors are its own."""
    sea = tiny.tokenizer.encode(" sea", add_special_tokens=False)[0]  # a token of ordinary text
    asks: list[dict[str, Any]] = [{"logit_bias": {str(sea): 100}}, {}, {"repetition_penalty": 1.5},
                                  {"temperature": 1.5, "seed": SEED, "min_p": 0.2}]
    with ThreadPoolExecutor(len(asks)) as pool:
        replies = list(pool.map(lambda ask: chat(client, 24, **{"temperature": 0, **ask}), asks))
    assert replies == [processed(tiny, 24, logit_bias={sea: 100}), tiny.chat(MESSAGES, 24),
                       processed(tiny, 24, repetition_penalty=1.5), seeded(tiny, 24, temp=1.5, min_p=0.2)]


def test_ollama_options_equal_mlx_lm(llama, tiny):
    def ollama_chat(**options: Any) -> str:
        text: str = llama.chat(model=TINY_MODEL_ID, messages=MESSAGES, options={"num_predict": 32, **options}).message.content
        return text

    recent = processed(tiny, 32, repetition_penalty=1.5, repetition_context_size=4)
    everything = processed(tiny, 32, repetition_penalty=1.5, repetition_context_size=EVERY_TOKEN)
    assert recent != everything  # the window changes this text: the test can fail
    assert ollama_chat(temperature=0, repeat_penalty=1.5, repeat_last_n=4) == recent
    assert ollama_chat(temperature=0, repeat_penalty=1.5, repeat_last_n=-1) == everything  # -1: num_ctx
    assert ollama_chat(temperature=0, repeat_penalty=1.5) == processed(tiny, 32, repetition_penalty=1.5,
                                                                         repetition_context_size=64)  # Ollama's default
    assert ollama_chat(temperature=0, repeat_penalty=1.5, repeat_last_n=0) == tiny.chat(MESSAGES, 32)  # 0: off
    assert ollama_chat(temperature=1.5, seed=SEED, min_p=0.2) == seeded(tiny, 32, temp=1.5, min_p=0.2)
    assert ollama_chat(temperature=1.5, seed=SEED, top_k=3) == seeded(tiny, 32, temp=1.5, top_k=3)


def test_a_whole_context_window_sees_the_cached_prompt_too(llama, tiny):
    """Asked twice, the prompt's start comes from the prompt cache the second time: a window of
    every token still penalises what is in it, past the last 256 prompt tokens."""
    words = "Paris river fisherman robot paint mountains questions answers friends"
    messages = [{"role": "user", "content": f"{words}. " + "x " * 400 + "Tell me about the sea."}]
    expected = tiny.chat(messages, 32, logits_processors=make_logits_processors(
        repetition_penalty=2.0, repetition_context_size=EVERY_TOKEN))
    assert expected != tiny.chat(messages, 32, logits_processors=make_logits_processors(
        repetition_penalty=2.0, repetition_context_size=256))  # the prompt's start matters: the test can fail
    options = {"num_predict": 32, "temperature": 0, "repeat_penalty": 2.0, "repeat_last_n": -1}
    first, again = (llama.chat(model=TINY_MODEL_ID, messages=messages, options=options) for _ in range(2))
    assert first.message.content == expected
    assert again.message.content == expected


def test_a_cards_top_k_and_min_p_apply_when_the_request_leaves_them_out(http, client, model_dir, tiny):
    card = {"model_id": "local/filtered", "path": str(model_dir), "sampling": {"temperature": 1.5, "min_p": 0.2}}
    assert http.post("/models/add", json=card).status_code == 200
    place(http, "local/filtered")
    ask = {"messages": MESSAGES, "max_tokens": 24, "seed": SEED}
    by_card = client.chat.completions.create(model="local/filtered", **ask).choices[0].message.content
    assert by_card == seeded(tiny, 24, temp=1.5, min_p=0.2)
    overridden = client.chat.completions.create(model="local/filtered", extra_body={"min_p": 0}, **ask)
    assert overridden.choices[0].message.content == seeded(tiny, 24, temp=1.5)
    assert ModelCard(model_id="a/b", sampling=SamplingDefaults(min_p=1.5)).problem() == \
        "sampling.min_p must be between 0 and 1, not 1.5"
    assert ModelCard(model_id="a/b", sampling=SamplingDefaults(top_k=-1)).problem() == \
        "sampling.top_k must be 0 (off) or more, not -1"


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/chat/completions", {"logit_bias": {str(n): 1 for n in range(301)}}, "logit_bias"),  # OpenAI's 300
    ("/v1/chat/completions", {"logit_bias": {"5": 100.5}}, "logit_bias"),
    ("/v1/chat/completions", {"logit_bias": {"5": -101}}, "logit_bias"),
    ("/v1/chat/completions", {"logit_bias": {"sea": 1}}, "logit_bias"),
    ("/v1/chat/completions", {"logit_bias": {"-1": 1}}, "logit_bias"),
    ("/v1/chat/completions", {"min_p": 1.01}, "min_p"),
    ("/v1/chat/completions", {"min_p": -0.1}, "min_p"),
    ("/v1/chat/completions", {"repetition_penalty": 0}, "repetition_penalty"),
    ("/v1/chat/completions", {"repetition_penalty": 10.5}, "repetition_penalty"),
    ("/v1/chat/completions", {"top_k": -2}, "top_k"),
    ("/v1/completions", {"logit_bias": {"5": 101}}, "logit_bias"),
    ("/v1/completions", {"min_p": 2}, "min_p"),
    ("/v1/completions", {"repetition_penalty": -1}, "repetition_penalty"),
    ("/v1/completions", {"top_k": -5}, "top_k"),
])
def test_out_of_bounds_sampling_fields_get_400_naming_the_field(http, tiny, path, body, param):
    ask = {"messages": MESSAGES} if path == "/v1/chat/completions" else {"prompt": "x"}
    response = http.post(path, json={"model": TINY_MODEL_ID, "max_tokens": 4, **ask, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error


@pytest.mark.parametrize(("options", "field"), [
    ({"repeat_last_n": -2}, "repeat_last_n"), ({"repeat_last_n": 4097}, "repeat_last_n"),
    ({"repeat_penalty": 0}, "repeat_penalty"), ({"repeat_penalty": 11}, "repeat_penalty"),
    ({"min_p": 1.5}, "min_p"),
])
def test_out_of_bounds_ollama_options_get_400_naming_the_option(http, tiny, options, field):
    response = http.post("/api/chat", json={"model": TINY_MODEL_ID, "messages": MESSAGES, "stream": False,
                                            "options": options})
    assert response.status_code == 400, response.text
    assert response.json()["error"].startswith(f"{field} must be"), response.text


def test_a_logit_bias_token_outside_the_vocabulary_is_refused_by_the_runner(http, client, tiny):
    vocab = tiny.model.args.vocab_size
    response = http.post("/v1/chat/completions", json={"model": TINY_MODEL_ID, "messages": MESSAGES, "max_tokens": 4,
                                                        "logit_bias": {"3": 1, str(vocab): 5, str(vocab + 7): -5}})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"] == (
        f"logit_bias has token ids outside this model's vocabulary (0 to {vocab - 1}): {vocab}, {vocab + 7}"), error
    # The runner is unharmed: the last id in the vocabulary is taken, and it serves on.
    assert chat(client, 4, temperature=0, logit_bias={str(vocab - 1): 100}) == processed(
        tiny, 4, logit_bias={vocab - 1: 100})
