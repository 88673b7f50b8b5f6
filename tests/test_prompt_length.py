"""The fewest tokens a prompt can be, from its length (exo/core/prompt_length.py): a prompt whose
floor fills the context is refused without tokenizing it, by the API (32 characters a token) and
by the runner (its tokenizer's longest token)."""

from __future__ import annotations

from pathlib import Path

import pytest

from exo.core.prompt_length import too_long
from exo.core.requests import ChatMessage, EmbedInputs, GenerationParams
from exo.runner.decoding import PromptTooLong
from exo.runner.engine import Engine
from tests.support.tiny_model import make_tiny_model


def chat(*contents: str) -> GenerationParams:
    return GenerationParams(messages=[ChatMessage(role="user", content=c) for c in contents])


def test_a_generation_whose_floor_fills_the_context_is_refused_and_one_token_less_is_not():
    assert too_long(chat("x" * 300, "y" * 19), context=10, chars_per_token=32) is None  # at least 9 tokens: it may fit
    assert too_long(chat("x" * 300, "y" * 20), context=10, chars_per_token=32) == (  # 10: no room left to answer
        "the prompt is 320 characters, at least 10 tokens (a token covers at most 32); this instance's context is 10")
    assert too_long(GenerationParams(prompt="x" * 320), context=10, chars_per_token=32) is not None
    assert too_long(chat("x" * 10**6), context=0, chars_per_token=32) is None  # context unknown
    assert too_long(chat("x" * 10**6), context=10, chars_per_token=0) is None  # tokenizer unknown


def test_an_embedding_input_may_fill_the_context_and_not_more():
    fills = GenerationParams(embed=EmbedInputs(texts=["hi", "x" * 320]))
    assert too_long(fills, context=10, chars_per_token=32) is None
    over = GenerationParams(embed=EmbedInputs(texts=["hi", "x" * 352]))
    assert too_long(over, context=10, chars_per_token=32) == (
        "input 1 is 352 characters, at least 11 tokens (a token covers at most 32): over the model's context of 10")


def test_the_runner_refuses_by_length_before_templating_and_lets_through_what_may_fit(tmp_path: Path):
    engine = Engine()
    engine.load(str(make_tiny_model(tmp_path / "tiny")))
    # The tiny tokenizer's longest entry is 17 characters; a normalizer may compose four into one.
    assert (engine.token_chars, engine.context_length) == (4 * 17, 32768)
    with pytest.raises(PromptTooLong, match="the prompt is 2228224 characters, at least 32768 tokens"):
        engine.prompt_for(chat("z" * (68 * 32768)))
    assert engine.prompt_for(chat("z" * (68 * 32768 - 1))).count("z") == 68 * 32768 - 1
