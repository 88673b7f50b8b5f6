"""A reference constraint for mlx-lm built on llguidance alone, with none of exo's code: what
exo's constrained answers are compared with (the tests must not check exo's grammar against itself).

`json_grammar(schema)` is llguidance's grammar of a JSON schema; `tool_call_grammar(tools)` is a
Lark grammar, in llguidance's syntax, of one or more Hermes/Qwen tool calls
(`<tool_call>{"name": ..., "arguments": ...}</tool_call>`, what mlx-lm's json_tools parser reads),
each naming one of the tools with arguments valid for its parameters. `Constrained` masks
mlx-lm's logits to what the grammar allows, with llguidance's own tokenizer bridge
(llguidance.hf) and bitmask helpers (llguidance.numpy)."""

from __future__ import annotations

import json
from typing import Any

import llguidance
import llguidance.hf
import llguidance.numpy
import mlx.core as mx
import numpy as np
from llguidance import LLMatcher

# exo compiles JSON without free whitespace (a weak model can repeat it until max_tokens): the
# reference must allow the same language, so it asks llguidance for the same option.
COMPACT = {"x-guidance": {"whitespace_flexible": False}}

_tokenizers: dict[int, tuple[Any, llguidance.LLTokenizer]] = {}


def ll_tokenizer(tokenizer: Any) -> llguidance.LLTokenizer:
    """llguidance's view of an mlx-lm tokenizer (its Hugging Face one, with mlx-lm's EOS ids)."""
    if id(tokenizer) not in _tokenizers:  # the bridge costs about a second: once per tokenizer
        hf = getattr(tokenizer, "_tokenizer", tokenizer)
        _tokenizers[id(tokenizer)] = (tokenizer, llguidance.hf.from_tokenizer(hf, eos_token=list(tokenizer.eos_token_ids)))
    return _tokenizers[id(tokenizer)][1]


def json_grammar(schema: dict[str, Any] | None) -> str:
    """Any JSON object (None), or a value valid for `schema`, written compactly."""
    return llguidance.grammar_from("json_schema", json.dumps((schema or {"type": "object"}) | COMPACT))


def tool_call_grammar(tools: list[dict[str, Any]]) -> str:
    """One or more `<tool_call>` JSON `</tool_call>` calls (the markers are the tokenizer's special
    tokens), each an object of exactly `name` (one tool's) and `arguments` (valid for its parameters),
    written compactly (no free whitespace, which a weak model can repeat until max_tokens)."""
    rules = []
    for n, tool in enumerate(tools):
        function = tool["function"]
        schema = {"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                  "properties": {"name": {"const": function["name"]},
                                 "arguments": function.get("parameters") or {"type": "object"}}}
        rules.append(f"tool{n}: %json {json.dumps(schema | COMPACT)}")
    tool_names = " | ".join(f"tool{n}" for n in range(len(tools)))
    return LLMatcher.grammar_from_lark("\n".join([
        "start: call+",
        'call: <tool_call> NL? body NL? </tool_call> NL?',
        f"body: {tool_names}",
        'NL: "\\n"',
        *rules]))


class Constrained:
    """An mlx-lm logits processor (`processor(tokens, logits) -> logits`): the first call sees the
    prompt, each later one a generated token more, which the matcher consumes before the next mask."""

    def __init__(self, tokenizer: Any, grammar: str) -> None:
        self._matcher = LLMatcher(ll_tokenizer(tokenizer), grammar)
        assert not self._matcher.is_error(), self._matcher.get_error()
        self._vocab = ll_tokenizer(tokenizer).vocab_size
        self._seen: int | None = None  # tokens already accounted for (the prompt, then each generated one)

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        if self._seen is not None:
            new: Any = tokens[self._seen:].tolist()
            for token in new:
                assert self._matcher.consume_token(int(token)), self._matcher.get_error()  # EOS too, once stopped
        self._seen = tokens.shape[0]
        bitmask = llguidance.numpy.allocate_token_bitmask(1, self._vocab)
        llguidance.numpy.fill_next_token_bitmask(self._matcher, bitmask)
        masked = np.array(logits.astype(mx.float32)).reshape(1, -1)
        llguidance.numpy.apply_token_bitmask_inplace(masked, bitmask)
        return mx.array(masked).reshape(logits.shape).astype(logits.dtype)
