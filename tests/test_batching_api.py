"""Batched decoding end to end: concurrent requests through the API to one instance of the tiny
model decode together in its runner, and each still equals mlx-lm's own single-request output."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.support.e2e import Reference, exo_serving, place
from tests.support.tiny_model import TINY_MODEL_ID, make_tiny_model

pytestmark = pytest.mark.slow

ASKS = ["Tell me about the sea.", "Hello", "Write a story about a robot who learns to paint.", "What is the capital of France?"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("model") / "tiny")


@pytest.fixture(scope="module")
def node(tmp_path_factory, model_dir):
    with exo_serving(tmp_path_factory.mktemp("node"), {TINY_MODEL_ID: model_dir}, {"EXO_MAX_BATCH": "8"}) as exo:
        yield exo


@pytest.fixture(scope="module")
def tiny(http, model_dir) -> Reference:
    place(http, TINY_MODEL_ID)
    return Reference(model_dir)


def streamed(client, messages: list[dict], max_tokens: int, **extra) -> dict:
    """One streamed chat completion: its text, usage, finish reason, and when its first text and its end came."""
    stream = client.chat.completions.create(model=TINY_MODEL_ID, messages=messages, max_tokens=max_tokens, stream=True,
                                            stream_options={"include_usage": True}, **extra)
    text, first, finish, usage = "", None, None, None
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or time.monotonic()
            text += chunk.choices[0].delta.content
        if chunk.choices and chunk.choices[0].finish_reason:
            finish = chunk.choices[0].finish_reason
        usage = chunk.usage or usage
    return {"text": text, "first": first, "done": time.monotonic(), "finish": finish, "usage": usage}


def test_concurrent_greedy_requests_decode_together_and_each_equals_mlx_lm(client, tiny):
    conversations = [[{"role": "user", "content": ask}] for ask in ASKS]
    lengths = [300, 340, 380, 420]
    with ThreadPoolExecutor(len(ASKS)) as pool:
        replies = list(pool.map(lambda c, n: streamed(client, c, n, temperature=0), conversations, lengths))
    for messages, n, reply in zip(conversations, lengths, replies):
        assert reply["text"] == tiny.chat(messages, n)
        assert reply["finish"] == "length" and reply["usage"].completion_tokens == n
        assert reply["usage"].prompt_tokens == tiny.prompt_tokens(tiny.chat_prompt(messages))
    # One at a time, a request's first text would come after the one before it ended.
    assert max(r["first"] for r in replies) < min(r["done"] for r in replies)


def test_a_seeded_request_shares_the_batch_and_is_still_repeatable(client, tiny):
    seeded = {"temperature": 1.5, "top_p": 0.95, "seed": 7}  # a sampler mlx-lm applies with the global seed
    alone = streamed(client, [{"role": "user", "content": ASKS[0]}], 24, **seeded)["text"]
    jobs = [(ASKS[1], 200, {"temperature": 0}), (ASKS[0], 24, seeded), (ASKS[2], 200, {"temperature": 0})]
    with ThreadPoolExecutor(len(jobs)) as pool:
        replies = list(pool.map(lambda job: streamed(client, [{"role": "user", "content": job[0]}], job[1], **job[2]), jobs))
    assert replies[1]["text"] == alone == tiny.sampled_chat([{"role": "user", "content": ASKS[0]}], 24, **seeded)
    # It runs alongside the others (once it waited for the batch to end, then held up the next).
    assert replies[1]["first"] < min(replies[0]["done"], replies[2]["done"])
    assert replies[0]["text"] == tiny.chat([{"role": "user", "content": ASKS[1]}], 200)
    assert replies[2]["text"] == tiny.chat([{"role": "user", "content": ASKS[2]}], 200)
