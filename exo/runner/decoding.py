"""One request's output, step by step, whichever engine produced the tokens (engine.py on mlx-lm,
vision_engine.py on mlx-vlm, batch.py's BatchGenerator): text, reasoning, tool calls, stop strings
and logprobs become Outputs for the runner; the result says why the request ended."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from exo.core.ids import TaskId
from exo.core.types import GenerationParams, TokenLogprob, ToolCall
from exo.runner.splitter import OutputSplitter
from exo.runner.stops import StopMatcher

if TYPE_CHECKING:
    from exo.runner.engine_api import ModelEngine


class Output:
    """What one decode step produced for the caller: text (content and reasoning), and tool calls /
    logprobs if asked for."""

    def __init__(self, text: str, completion_tokens: int, prompt_tokens: int,
                 logprobs: list[TokenLogprob], tool_calls: list[ToolCall], cached_tokens: int = 0,
                 reasoning: str = "") -> None:
        self.text = text
        self.reasoning = reasoning
        self.cached_tokens = cached_tokens  # of prompt_tokens, reused from the prompt cache
        self.completion_tokens = completion_tokens
        self.prompt_tokens = prompt_tokens
        self.logprobs = logprobs
        self.tool_calls = tool_calls


OnOutput = Callable[[Output], None]


class GenerationResult:
    def __init__(self, finish_reason: str, prompt_tokens: int, completion_tokens: int, stop_sequence: str = "",
                 cached_tokens: int = 0) -> None:
        self.finish_reason = finish_reason
        self.prompt_tokens = prompt_tokens
        self.completion_tokens = completion_tokens
        self.stop_sequence = stop_sequence
        self.cached_tokens = cached_tokens  # prompt tokens reused from the prompt cache


class RequestRefused(ValueError):
    """The client's mistake, found before any work (and before any collective): a 400, with `code`."""

    code = "invalid_request_error"


class PromptTooLong(RequestRefused):
    """The prompt alone fills the model's context: nothing could be generated."""

    code = "context_length_exceeded"


class Decoding:
    """One request's output, one mlx-lm step at a time: tool calls, stop strings, logprobs.

    The single path (Engine.generate) feeds it stream_generate's responses, the batch
    (batch.py) BatchGenerator's, detokenized the same way, so both send the same chunks."""

    def __init__(self, engine: ModelEngine, params: GenerationParams, on_output: OnOutput, task_id: TaskId,
                 prompt: list[int], cached: int = 0) -> None:
        self._engine = engine
        self.cached = cached
        self._top_logprobs = params.top_logprobs if params.logprobs else -1
        self._on_output = on_output
        self._stops = StopMatcher(params.stop)
        # A raw prompt (completions) gets its text whole: only a chat's answer has reasoning apart.
        self._splitter = OutputSplitter(engine.tokenizer, params.tools, task_id[:12], prompt,
                                        reasoning=params.prompt is None)
        self.prompt_tokens = self.completion_tokens = 0
        self.finish_reason = "length"

    def step(self, text: str, token: int | None, logprobs: Any, prompt_tokens: int, completion_tokens: int,
             finish_reason: str | None) -> GenerationResult | None:
        """Sends what this step produced; returns the result once a stop string ends the request.
        `token` None: text with no new token (an engine's closing record)."""
        self._engine.beat()
        self.prompt_tokens, self.completion_tokens = prompt_tokens, completion_tokens
        self.finish_reason = finish_reason or self.finish_reason
        wanted = self._top_logprobs >= 0 and token is not None
        entries = [self._engine.logprob(token, logprobs, self._top_logprobs)] if wanted and token is not None else []
        split = self._splitter.feed(text)
        text = self._stops.feed(split.text)  # stop strings end the answer, not the reasoning
        if text or split.reasoning or split.calls or entries:
            self._on_output(Output(text, completion_tokens, prompt_tokens, entries, split.calls, self.cached, split.reasoning))
        return self._stopped() if self._stops.stopped else None

    def cancelled(self) -> GenerationResult:
        return GenerationResult("cancelled", self.prompt_tokens, self.completion_tokens, cached_tokens=self.cached)

    def finish(self) -> GenerationResult:
        """mlx-lm ended the request (EOS or max_tokens): what the tool parser and stop strings held back."""
        split = self._splitter.finish(self.finish_reason)
        text = self._stops.feed(split.text)
        text += "" if self._stops.stopped else self._stops.flush()
        if text or split.reasoning or split.calls:
            self._on_output(Output(text, self.completion_tokens, self.prompt_tokens, [], split.calls, self.cached,
                                   split.reasoning))
        return self._stopped() if self._stops.stopped else GenerationResult(
            self.finish_reason, self.prompt_tokens, self.completion_tokens, cached_tokens=self.cached)

    def _stopped(self) -> GenerationResult:
        return GenerationResult("stop", self.prompt_tokens, self.completion_tokens, self._stops.matched, self.cached)
