"""Models shaped like the ones users run, exact against mlx-lm: a qwen3 architecture whose EOS
the model emits (tests/support/qwen_model.py), its 4-bit copy and a 4-bit llama, both made by
mlx-lm's `convert -q`. Greedy text and finish reason (EOS: "stop") equal mlx-lm's own, in one
process with requests joining a batch, and on two ranks (tensor and pipeline) in lockstep."""

from __future__ import annotations

from functools import cache
from pathlib import Path

import mlx_lm
import pytest

from exo.runner.engine import Engine
from tests.support.lockstep_ranks import params_of
from tests.support.qwen_model import EOS_PROMPT, EOS_WITHIN, make_4bit, make_qwen3_model
from tests.support.tiny_model import Dims, make_tiny_model
from tests.test_batching import together
from tests.test_lockstep_batch import LAYERS, on_two_ranks

pytestmark = pytest.mark.slow

REQUESTS = [
    {"text": EOS_PROMPT[0]["content"], "max_tokens": EOS_WITHIN},
    {"text": "Tell me about the sea.", "max_tokens": 40, "join_after": [0, 2]},
    {"text": "What is the capital of France?", "max_tokens": 32},
    {"text": "Once upon a time", "max_tokens": 24, "join_after": [2, 5]},
]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("shaped")
    qwen = make_qwen3_model(root / "qwen3", layers=LAYERS)
    llama = make_tiny_model(root / "llama", Dims(layers=LAYERS))
    return {"qwen3": qwen, "qwen3-4bit": make_4bit(qwen, root / "qwen3-4bit"),
            "llama-4bit": make_4bit(llama, root / "llama-4bit")}


@cache  # greedy: the same for each of a model's tests (a model's directory is made once, per module)
def mlx_lm_reference(model_dir: Path) -> list[list]:
    """[text, finish reason] of each request, from mlx-lm's stream_generate, greedy."""
    model, tokenizer = mlx_lm.load(str(model_dir))
    answers = []
    for request in REQUESTS:
        messages = [{"role": "user", "content": request["text"]}]
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        steps = list(mlx_lm.stream_generate(model, tokenizer, prompt, max_tokens=request["max_tokens"]))
        answers.append(["".join(step.text for step in steps), steps[-1].finish_reason])
    return answers


@pytest.mark.parametrize("name", ["qwen3", "qwen3-4bit", "llama-4bit"])
def test_one_process_batched_equals_mlx_lm(models, name):
    expected = mlx_lm_reference(models[name])
    if name.startswith("qwen3"):
        assert expected[0][1] == "stop"  # the model ends its answer with EOS, as chat models do
    engine = Engine()
    engine.load(str(models[name]))
    engine.prompt_cache.max_bytes = 0
    batched = together(engine, [params_of(r) for r in REQUESTS], join_every=2)
    assert [["".join(o[0] for o in out), done[0]] for out, done in batched] == expected


@pytest.mark.parametrize("sharding", ["tensor", "pipeline"])
@pytest.mark.parametrize("name", ["qwen3", "qwen3-4bit", "llama-4bit"])
def test_two_ranks_equal_mlx_lm(models, name, sharding):
    expected = mlx_lm_reference(models[name])
    got = on_two_ranks(models[name], sharding, REQUESTS)
    assert [answer[:2] for answer in got] == expected
