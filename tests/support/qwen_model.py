"""Test models shaped like the ones users run: a qwen3 architecture (q/k norms) on the tiny
model's ByteLevel BPE tokenizer and ChatML template, whose EOS (`<|im_end|>`) the model really
emits; and 4-bit copies made with mlx-lm's own `convert -q`.

The tiny model never ends a reply: its lm_head forbids special tokens. Here EOS gets the
lm_head row of a token the model writes a few tokens into its greedy answer to "Hello", plus a
little: wherever that token would win, EOS wins, so greedy generation stops there (finish
reason "stop"), as real chat models stop.
"""

from __future__ import annotations

import json
import pathlib

import mlx_lm
import numpy as np
from mlx_lm.convert import convert
from safetensors.numpy import load_file, save_file

from tests.support.tiny_model import EOS, Dims, make_tiny_model

QWEN_MODEL_ID = "exo-test/tiny-qwen3"
EOS_PROMPT = [{"role": "user", "content": "Hello"}]  # greedy, the model ends its answer to this with EOS...
EOS_WITHIN = 20  # ...within this many tokens (at the first token from the 4th on that it had not written yet)


def make_qwen3_model(path: pathlib.Path, layers: int = 4) -> pathlib.Path:
    d = Dims(layers=layers)
    make_tiny_model(path, d)
    config = json.loads((path / "config.json").read_text())
    config |= {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]}
    (path / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    weights = load_file(str(path / "model.safetensors"))
    for n in range(layers):
        weights[f"model.layers.{n}.self_attn.q_norm.weight"] = np.ones(d.head_dim, np.float32)
        weights[f"model.layers.{n}.self_attn.k_norm.weight"] = np.ones(d.head_dim, np.float32)
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "mlx"})
    _make_eos_reachable(path, weights)
    return path


def _make_eos_reachable(path: pathlib.Path, weights: dict[str, np.ndarray]) -> None:
    model, tokenizer = mlx_lm.load(str(path))
    prompt = tokenizer.apply_chat_template(EOS_PROMPT, add_generation_prompt=True, tokenize=False)
    tokens = [r.token for r in mlx_lm.stream_generate(model, tokenizer, prompt, max_tokens=EOS_WITHIN)]
    ender = next(token for step, token in enumerate(tokens) if step >= 3 and token not in tokens[:step])
    eos = tokenizer.convert_tokens_to_ids(EOS)
    lm_head = weights["lm_head.weight"]
    lm_head[eos] = lm_head[ender]
    lm_head[eos, 0] += 0.5  # channel 0 is the constant one: EOS now beats `ender` wherever it would win
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "mlx"})


def make_4bit(source: pathlib.Path, path: pathlib.Path) -> pathlib.Path:
    """A 4-bit copy, as `mlx_lm.convert --hf-path source -q --q-bits 4` makes it."""
    convert(hf_path=str(source), mlx_path=str(path), quantize=True, q_bits=4, q_group_size=32)
    return path
