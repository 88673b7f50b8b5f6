"""The thin layer over mlx-lm. One thread owns mlx: every method here runs on it."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import mlx.core as mx
from mlx_lm import load, stream_generate
from mlx_lm.sample_utils import make_logits_processors, make_sampler

from exo.core.types import GenerationParams, SamplingDefaults, TokenLogprob, ToolCall, TopLogprob
from exo.runner.stops import StopMatcher
from exo.runner.tool_calls import ToolCallSplitter

DEFAULT_MAX_TOKENS = 2048



class Output:
    """What one decode step produced for the caller: text, and tool calls / logprobs if asked for."""

    def __init__(self, text: str, completion_tokens: int, prompt_tokens: int,
                 logprobs: list[TokenLogprob], tool_calls: list[ToolCall]) -> None:
        self.text = text
        self.completion_tokens = completion_tokens
        self.prompt_tokens = prompt_tokens
        self.logprobs = logprobs
        self.tool_calls = tool_calls


OnOutput = Callable[[Output], None]


class GenerationResult:
    def __init__(self, finish_reason: str, prompt_tokens: int, completion_tokens: int, stop_sequence: str = "") -> None:
        self.finish_reason = finish_reason
        self.prompt_tokens = prompt_tokens
        self.completion_tokens = completion_tokens
        self.stop_sequence = stop_sequence


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
        if params.prompt is not None and text is None:
            return params.prompt  # completions: the caller's text is the whole prompt
        messages = _template_messages(params) if text is None else [{"role": "user", "content": text}]
        if getattr(self.tokenizer, "chat_template", None):
            return self.tokenizer.apply_chat_template(
                messages, tools=params.tools or None, add_generation_prompt=True, tokenize=False
            )
        return "\n".join(m["content"] for m in messages)

    def generate(
        self,
        params: GenerationParams,
        defaults: SamplingDefaults,
        on_output: OnOutput,
        is_cancelled: Callable[[], bool],
        task_id: str = "",
    ) -> GenerationResult:
        stops = StopMatcher(params.stop)
        tools = ToolCallSplitter(self.tokenizer, params.tools, task_id[:12])
        prompt_tokens = completion_tokens = 0
        finish_reason = "length"
        for response in stream_generate(
            self.model, self.tokenizer, self.prompt_for(params), max_tokens=params.max_tokens or DEFAULT_MAX_TOKENS,
            sampler=_sampler(params, defaults), logits_processors=make_logits_processors(
                presence_penalty=params.presence_penalty, frequency_penalty=params.frequency_penalty),
        ):
            prompt_tokens, completion_tokens = response.prompt_tokens, response.generation_tokens
            finish_reason = response.finish_reason or finish_reason
            logprobs = [self._logprob(response, params.top_logprobs)] if params.logprobs else []
            content, calls = tools.feed(response.text)
            text = stops.feed(content)
            if text or calls or logprobs:
                on_output(Output(text, completion_tokens, prompt_tokens, logprobs, calls))
            if stops.stopped:
                return GenerationResult("stop", prompt_tokens, completion_tokens, stops.matched)
            if is_cancelled():
                return GenerationResult("cancelled", prompt_tokens, completion_tokens)
        content, calls = tools.finish(finish_reason)
        text = stops.feed(content)
        text += "" if stops.stopped else stops.flush()
        if text or calls:
            on_output(Output(text, completion_tokens, prompt_tokens, [], calls))
        if stops.stopped:
            return GenerationResult("stop", prompt_tokens, completion_tokens, stops.matched)
        return GenerationResult(finish_reason, prompt_tokens, completion_tokens)

    def _logprob(self, response: Any, top: int) -> TokenLogprob:
        logprobs = response.logprobs.reshape(-1)
        alternatives: list[TopLogprob] = []
        top = min(top, logprobs.size - 1)
        if top > 0:
            ids = mx.argpartition(-logprobs, kth=top - 1)[:top]
            ranked = sorted(zip(ids.tolist(), logprobs[ids].tolist()), key=lambda pair: -pair[1])
            alternatives = [TopLogprob(token=self._token_text(i), logprob=v) for i, v in ranked]
        token = response.token
        return TokenLogprob(token=self._token_text(token), logprob=logprobs[token].item(), top_logprobs=alternatives)

    def _token_text(self, token: int) -> str:
        return self.tokenizer.decode([token])


def _sampler(params: GenerationParams, defaults: SamplingDefaults) -> Callable:
    temperature = _first(params.temperature, defaults.temperature, 0.0)
    top_p = _first(params.top_p, defaults.top_p, 0.0)
    if params.seed is not None:
        mx.random.seed(params.seed)
    return make_sampler(temp=temperature, top_p=top_p if top_p < 1.0 else 0.0, top_k=params.top_k or 0)


def _template_messages(params: GenerationParams) -> list[dict]:
    """Messages as chat templates expect them, with earlier turns' tool calls and results."""
    turns = {turn.index: turn for turn in params.tool_turns}
    messages = []
    for index, message in enumerate(params.messages):
        entry: dict[str, Any] = {"role": message.role, "content": message.content}
        turn = turns.get(index)
        if turn is not None and turn.tool_calls:
            entry["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": _arguments(c.arguments)}}
                for c in turn.tool_calls
            ]
        if turn is not None and turn.tool_call_id:
            entry["tool_call_id"] = turn.tool_call_id
        if turn is not None and turn.name:
            entry["name"] = turn.name
        messages.append(entry)
    return messages


def _arguments(text: str) -> Any:
    # Templates render arguments as a mapping (mlx-lm's server decodes them the same way).
    try:
        return json.loads(text)
    except ValueError:
        return text


def _first(*values: float | None) -> float:
    return next(v for v in values if v is not None)
