"""The tiny test model, taught to call a tool: a real mlx-lm model whose greedy output is a
tool call in the Hermes/Qwen format (`<tool_call>{json}</tool_call>`) when the chat template
offers tools and the user spoke last, and ordinary text otherwise.

How (all deterministic, written in milliseconds):

* Tokens added to the tokenizer: a trigger `<|call|>` that the chat template puts at the end
  of the generation prompt when tools are offered and the last message is the user's, the
  markers `<tool_call>` / `</tool_call>`, and the call's JSON as one token.
* Four hidden dimensions are "slots" that only these tokens' embeddings use and no layer
  writes to. A large value in slot i makes the lm_head pick the next token of the chain
  `<|call|> -> <tool_call> -> JSON -> </tool_call> -> EOS`, whatever the layers add.
  Everywhere else the slots are zero, so the model generates text as the tiny model does.
* The template names `<tool_call>` and `tool_call.name`, so mlx-lm picks its `json_tools`
  parser for this tokenizer, as it does for Qwen and Hermes models.
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Callable
from typing import Any

import numpy as np
from safetensors.numpy import load_file, save_file
from tokenizers import AddedToken, Tokenizer

from tests.support.tiny_model import EOS, Dims, make_tiny_model

TOOL_MODEL_ID = "exo-test/tiny-tools"

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CALL_NAME = "get_weather"
CALL_ARGUMENTS = {"city": "Paris"}

TRIGGER = "<|call|>"
CALL_JSON = "\n" + json.dumps({"name": CALL_NAME, "arguments": CALL_ARGUMENTS}) + "\n"
CHAIN = [TRIGGER, "<tool_call>", CALL_JSON, "</tool_call>"]  # each one's successor is the next; the last's is EOS

TOOL_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}<|im_start|>system\n<tools>{% for tool in tools %}{{ tool | tojson }}{% endfor %}"
    "</tools><|im_end|>\n{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'tool' %}"
    "<|im_start|>user\n<tool_response>{{ message.content }}</tool_response><|im_end|>\n"
    "{% elif message.role == 'assistant' and message.tool_calls %}"
    "<|im_start|>assistant\n{{ message.content or '' }}"
    "{% for tool_call in message.tool_calls %}"
    "{% if tool_call.function %}{% set tool_call = tool_call.function %}{% endif %}"
    "<tool_call>{\"name\": \"{{ tool_call.name }}\", \"arguments\": {{ tool_call.arguments | tojson }}}</tool_call>"
    "{% endfor %}<|im_end|>\n"
    "{% else %}"
    "<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if tools and messages[-1].role == 'user' %}" + TRIGGER + "{% endif %}{% endif %}"
)

_SLOT_VALUE = 200.0  # dwarfs what the layers add, so the chain always wins
_SLOT_WEIGHT = 50.0


def make_tool_model(path: pathlib.Path, dims: Dims = Dims()) -> pathlib.Path:
    path = make_tiny_model(pathlib.Path(path), dims)
    special = [t for t in CHAIN if t != CALL_JSON]
    return add_chain(path, special, [CALL_JSON], [*CHAIN, EOS], blocked=CHAIN, template=TOOL_TEMPLATE)


def add_chain(path: pathlib.Path, special: list[str], plain: list[str], chain: list[str], blocked: list[str],
              template: str) -> pathlib.Path:
    """Teach the tiny model at `path` a chain: after chain[i] its greedy next token is chain[i+1].
    `special` and `plain` are the tokens added to the tokenizer; `blocked` tokens are never
    generated except as a chain's next token; `template` becomes the chat template."""
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in plain])
    (path / "tokenizer.json").write_text(tok.to_str(pretty=True), encoding="utf-8")
    vocab = tok.get_vocab_size()
    _rewrite_json(path / "tokenizer_config.json", lambda c: c | {"chat_template": template})
    _rewrite_json(path / "config.json", lambda c: c | {"vocab_size": vocab})
    weights = load_file(str(path / "model.safetensors"))

    def token_id(token: str) -> int:
        found = tok.token_to_id(token)
        assert found is not None, f"{token!r} is not in the vocabulary"
        return found

    _rig_weights(weights, [token_id(t) for t in chain], [token_id(t) for t in blocked], vocab)
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "mlx"})
    return path


def _rig_weights(w: dict[str, np.ndarray], chain_ids: list[int], blocked_ids: list[int], vocab: int) -> None:
    rng = np.random.default_rng(99)
    hidden = w["model.embed_tokens.weight"].shape[1]
    slots = list(range(hidden - (len(chain_ids) - 1), hidden))
    embed = _grow(w["model.embed_tokens.weight"], vocab, rng)
    lm_head = _grow(w["lm_head.weight"], vocab, rng)
    embed[:, slots] = 0.0
    lm_head[:, slots] = 0.0
    for name, weight in w.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            weight[slots] = 0.0  # no layer writes a slot
    for n, slot in enumerate(slots):
        embed[chain_ids[n], slot] = _SLOT_VALUE
        lm_head[chain_ids[n + 1], slot] = _SLOT_WEIGHT
    for token in blocked_ids:
        lm_head[token, 0] = -1000.0  # never generated except as a chain's next token
    w["model.embed_tokens.weight"] = embed
    w["lm_head.weight"] = lm_head


def _grow(matrix: np.ndarray, rows: int, rng: np.random.Generator) -> np.ndarray:
    extra = rng.normal(0.0, 1.0, size=(rows - matrix.shape[0], matrix.shape[1])).astype(matrix.dtype)
    grown = np.concatenate([matrix, extra])
    grown[matrix.shape[0]:, 0] = matrix[0, 0]  # keep the embedding's constant bias channel
    return grown


def _rewrite_json(file: pathlib.Path, change: Callable[[dict[str, Any]], dict[str, Any]]) -> None:
    file.write_text(json.dumps(change(json.loads(file.read_text())), indent=2, sort_keys=True) + "\n", encoding="utf-8")
