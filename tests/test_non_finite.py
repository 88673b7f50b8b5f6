"""A model whose logits turn NaN fails the request with that reason, on the single path and in a
batch, rather than sampling noise until max_tokens (exo/runner/decoding.py's check on each token)."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import mlx.core as mx
import pytest

from exo.core.requests import ChatMessage, GenerationParams
from exo.core.types import SamplingDefaults
from exo.runner.batch import Batcher
from exo.runner.decoding import NonFiniteLogits
from exo.runner.engine import Engine
from tests.support.tiny_model import make_tiny_model

PARAMS = GenerationParams(messages=[ChatMessage(role="user", content="Tell me about the sea.")], max_tokens=20,
                          temperature=0.0)
SAYS = "the model's logits are not finite (NaN or infinite) at generated token 1"


@pytest.fixture(scope="module")
def poisoned(tmp_path_factory) -> Engine:
    """The tiny model with a NaN in its final norm: every logit is NaN from the first token on."""
    engine = Engine()
    engine.load(str(make_tiny_model(tmp_path_factory.mktemp("tiny") / "model")))
    norm = engine.model.model.norm
    norm.weight = mx.where(mx.arange(norm.weight.size) == 3, mx.nan, norm.weight)
    return engine


def test_a_request_alone_fails_with_the_reason(poisoned):
    sent = []
    with pytest.raises(NonFiniteLogits) as raised:
        poisoned.generate(PARAMS, SamplingDefaults(), sent.append, lambda: False)
    assert str(raised.value).startswith(SAYS)
    assert sent == []  # not one token of noise went out


def test_a_request_in_a_batch_fails_with_the_reason(poisoned):
    async def run() -> list:
        batcher = Batcher(poisoned, 8, ThreadPoolExecutor(max_workers=1))
        loop = asyncio.get_running_loop()
        futures = [batcher.run(loop, PARAMS, SamplingDefaults(), lambda _: None, lambda: False, f"t{i}") for i in range(2)]
        return await asyncio.gather(*futures, return_exceptions=True)

    outcomes = asyncio.run(run())
    assert [type(o) for o in outcomes] == [NonFiniteLogits, NonFiniteLogits]
    assert all(str(o).startswith(SAYS) for o in outcomes)
