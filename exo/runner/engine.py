"""The thin layer over mlx-lm. One thread owns mlx: every method here runs on it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx
from mlx_lm import load, stream_generate
from mlx_lm.sample_utils import make_sampler

from exo.core.types import GenerationParams, SamplingDefaults
from exo.runner.stops import StopMatcher

DEFAULT_MAX_TOKENS = 2048

# Called per piece of text: (text, completion tokens so far, prompt tokens).
OnText = Callable[[str, int, int], None]


class GenerationResult:
    def __init__(self, finish_reason: str, prompt_tokens: int, completion_tokens: int) -> None:
        self.finish_reason = finish_reason
        self.prompt_tokens = prompt_tokens
        self.completion_tokens = completion_tokens


class Engine:
    def __init__(self) -> None:
        self.model: Any = None
        self.tokenizer: Any = None

    def load(self, model_path: str) -> None:
        self.model, self.tokenizer = load(model_path)

    def warm_up(self) -> None:
        """One short generation, so the first real request does not pay for kernel set-up."""
        prompt = self.prompt_for(GenerationParams(messages=[]), text="warm up")
        for _ in stream_generate(self.model, self.tokenizer, prompt, max_tokens=2):
            pass

    def prompt_for(self, params: GenerationParams, text: str | None = None) -> str:
        messages = [{"role": m.role, "content": m.content} for m in params.messages]
        if text is not None:
            messages = [{"role": "user", "content": text}]
        if getattr(self.tokenizer, "chat_template", None):
            return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return "\n".join(m["content"] for m in messages)

    def generate(
        self,
        params: GenerationParams,
        defaults: SamplingDefaults,
        on_text: OnText,
        is_cancelled: Callable[[], bool],
    ) -> GenerationResult:
        temperature = _first(params.temperature, defaults.temperature, 0.0)
        top_p = _first(params.top_p, defaults.top_p, 0.0)
        if params.seed is not None:
            mx.random.seed(params.seed)
        sampler = make_sampler(temp=temperature, top_p=top_p if top_p < 1.0 else 0.0)
        stops = StopMatcher(params.stop)
        prompt_tokens = completion_tokens = 0
        finish_reason = "length"
        max_tokens = params.max_tokens or DEFAULT_MAX_TOKENS
        prompt = self.prompt_for(params)
        for response in stream_generate(self.model, self.tokenizer, prompt, max_tokens=max_tokens, sampler=sampler):
            prompt_tokens, completion_tokens = response.prompt_tokens, response.generation_tokens
            finish_reason = response.finish_reason or finish_reason
            text = stops.feed(response.text)
            if text:
                on_text(text, completion_tokens, prompt_tokens)
            if stops.stopped:
                return GenerationResult("stop", prompt_tokens, completion_tokens)
            if is_cancelled():
                return GenerationResult("cancelled", prompt_tokens, completion_tokens)
        rest = stops.flush()
        if rest:
            on_text(rest, completion_tokens, prompt_tokens)
        return GenerationResult(finish_reason, prompt_tokens, completion_tokens)


def _first(*values: float | None) -> float:
    return next(v for v in values if v is not None)
