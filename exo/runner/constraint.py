"""Constrained decoding: a logits processor that lets the model write only what the request's
grammar allows (exo/core/grammar.py: JSON for a response_format, a tool call when one is required).

llguidance (the grammar engine llama.cpp and vLLM use; no torch) compiles the schema and, at each
step, says which tokens may come next; the processor masks every other token. It follows mlx-lm's
logits-processor interface, `processor(tokens, logits) -> logits`, the same on the single path
(stream_generate) and in a batch (each request has its own). The first call sees the prompt; every
later call sees one more generated token last, which the grammar consumes before the next mask.

A prompt that ends inside a thinking block is left free until the model closes it: the grammar
constrains the answer, not the reasoning.
"""

from __future__ import annotations

import functools
from typing import Any

import llguidance
import llguidance.hf
import mlx.core as mx
import numpy as np
from llguidance import LLMatcher


@functools.lru_cache(maxsize=8)
def _ll_tokenizer(tokenizer: Any) -> llguidance.LLTokenizer:
    hf = getattr(tokenizer, "_tokenizer", tokenizer)  # mlx-lm's TokenizerWrapper holds the Hugging Face one
    return llguidance.hf.from_tokenizer(hf, eos_token=sorted(tokenizer.eos_token_ids))


class GrammarConstraint:
    """One request's constraint: masks each step's logits to the tokens its grammar allows."""

    def __init__(self, tokenizer: Any, grammar: str, in_reasoning: bool = False) -> None:
        self._matcher = LLMatcher(_ll_tokenizer(tokenizer), grammar)
        if self._matcher.is_error():
            raise ValueError(f"response_format cannot be enforced: {self._matcher.get_error()}")
        self._think_end = tuple(getattr(tokenizer, "think_end_tokens", None) or ()) if in_reasoning else ()
        self._free = bool(self._think_end)  # until the model closes its thinking
        self._recent: list[int] = []
        self._started = False

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        if self._started:
            last: Any = tokens[-1].item()
            self._take(int(last))
        self._started = True
        if self._free:
            return logits
        allowed = np.unpackbits(np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
        width = logits.shape[-1]
        mask = np.zeros(width, dtype=bool)
        mask[:min(width, allowed.size)] = allowed[:width].astype(bool)
        return mx.where(mx.array(mask), logits, mx.array(-float("inf"), dtype=logits.dtype))

    def advance(self, tokens: list[int]) -> None:
        """Tokens chosen before this processor's first call (a resumed request's earlier ones): the
        grammar consumes them as if it had masked their steps, so the first mask continues from them."""
        for token in tokens:
            self._take(token)

    def _take(self, token: int) -> None:
        if self._free:
            self._recent = (self._recent + [token])[-len(self._think_end):]
            self._free = tuple(self._recent) != self._think_end
            return
        if not self._matcher.consume_token(token):
            raise ValueError(f"the constrained output went off its grammar: {self._matcher.get_error()}")
