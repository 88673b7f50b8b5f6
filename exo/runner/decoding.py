"""One request's output, step by step, whichever engine produced the tokens (engine.py on mlx-lm,
vision_engine.py on mlx-vlm, batch.py's BatchGenerator): text, reasoning, tool calls, stop strings
and logprobs become Outputs for the runner; the result says why the request ended."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from exo.core.ids import TaskId
from exo.core.requests import ChoiceEnd, GenerationParams, TokenLogprob, ToolCall
from exo.runner.splitter import OutputSplitter, Split
from exo.runner.stops import StopMatcher

if TYPE_CHECKING:
    from exo.runner.engine_api import ModelEngine


class Output:
    """What one decode step produced for the caller: text (content and reasoning), and tool calls /
    logprobs if asked for. `tokens`: the ids of every token since the previous Output, whose text
    this one completes (a runner that takes the request over prefills them: see Decoding.replay)."""

    def __init__(self, text: str, completion_tokens: int, prompt_tokens: int,
                 logprobs: list[TokenLogprob], tool_calls: list[ToolCall], cached_tokens: int = 0,
                 reasoning: str = "", tokens: list[int] | None = None) -> None:
        self.text = text
        self.reasoning = reasoning
        self.cached_tokens = cached_tokens  # of prompt_tokens, reused from the prompt cache
        self.completion_tokens = completion_tokens
        self.prompt_tokens = prompt_tokens
        self.logprobs = logprobs
        self.tool_calls = tool_calls
        self.tokens = tokens if tokens is not None else []
        self.choice = 0  # which of the request's choices (n > 1: set by its row in the batch)


OnOutput = Callable[[Output], None]


class GenerationResult:
    def __init__(self, finish_reason: str, prompt_tokens: int, completion_tokens: int, stop_sequence: str = "",
                 cached_tokens: int = 0, draft_tokens: int = 0) -> None:
        self.finish_reason = finish_reason
        self.prompt_tokens = prompt_tokens
        self.completion_tokens = completion_tokens
        self.stop_sequence = stop_sequence
        self.cached_tokens = cached_tokens  # prompt tokens reused from the prompt cache
        self.draft_tokens = draft_tokens  # completion tokens a draft model proposed and the model accepted
        self.choices: list[ChoiceEnd] = []  # n > 1: how each choice ended (its counts are summed above)


class RequestRefused(ValueError):
    """The client's mistake, found before any work (and before any collective): a 400, with `code`."""

    code = "invalid_request_error"


class PromptTooLong(RequestRefused):
    """The prompt alone fills the model's context: nothing could be generated."""

    code = "context_length_exceeded"


class NonFiniteLogits(RuntimeError):
    """The model's output turned NaN or infinite: any token sampled from it is noise, so the request fails."""


# The exponent bits of the two 16-bit float formats (memoryview's format names): all set is NaN or infinity.
_EXPONENT_BITS = {"e": 0x7C00, "bfloat16": 0x7F80}


def finite_at(values: Any, index: int) -> bool:
    """Whether the evaluated array `values` holds a finite number at flat `index`. Read from the array's
    own memory (under a microsecond): an mlx op instead would wait for the step the engine queued next."""
    try:
        view = memoryview(values)
        raw, fmt = view.cast("B"), view.format
    except (TypeError, ValueError):  # not one contiguous buffer: unchecked rather than copied
        return True
    if fmt in _EXPONENT_BITS:
        bits = _EXPONENT_BITS[fmt]
        return raw.cast("H")[index] & bits != bits
    if fmt == "f":
        return math.isfinite(raw.cast("f")[index])
    return True


class Decoding:
    """One request's output, one mlx-lm step at a time: tool calls, stop strings, logprobs.

    The single path (Engine.generate) feeds it stream_generate's responses, the batch
    (batch.py) BatchGenerator's, detokenized the same way, so both send the same chunks."""

    def __init__(self, engine: ModelEngine, params: GenerationParams, on_output: OnOutput, task_id: TaskId,
                 prompt: list[int], cached: int = 0) -> None:
        self._engine = engine
        self.cached = cached
        self.draft_tokens = 0  # accepted from a draft model (speculative decoding)
        self._top_logprobs = params.top_logprobs if params.logprobs else -1
        self._on_output = on_output
        self._stops = StopMatcher(params.stop)
        # A raw prompt (completions) gets its text whole: only a chat's answer has reasoning apart.
        self._splitter = OutputSplitter(engine.tokenizer, params.tools, task_id[:12], prompt,
                                        reasoning=params.prompt is None)
        self.prompt_tokens = self.completion_tokens = 0
        self.finish_reason = "length"
        self._tokens: list[int] = []  # fed since the last Output: they go out with the next one
        self._ended = False  # what was held back at the end went out

    def step(self, text: str, token: int | None, logprobs: Any, prompt_tokens: int, completion_tokens: int,
             finish_reason: str | None) -> GenerationResult | None:
        """Sends what this step produced; returns the result once the request ended: by a stop
        string, or `finish_reason` (then what was held back goes out in this step's Output, so the
        last Output carries the last token, EOS included: a resumed run knows the text was all out).
        `token` None: text with no new token (an engine's closing record)."""
        self._engine.beat()
        self.prompt_tokens, self.completion_tokens = prompt_tokens, completion_tokens
        self.finish_reason = finish_reason or self.finish_reason
        if token is not None:
            self._tokens.append(token)
            if logprobs is not None and not finite_at(logprobs, token):
                raise NonFiniteLogits(f"the model's logits are not finite (NaN or infinite) at generated token "
                                      f"{completion_tokens}: its weights (or its adapter's) overflowed or hold NaN")
        wanted = self._top_logprobs >= 0 and token is not None
        entries = [self._engine.logprob(token, logprobs, self._top_logprobs)] if wanted and token is not None else []
        split = self._splitter.feed(text)
        split = split._replace(text=self._stops.feed(split.text))  # stop strings end the answer, not the reasoning
        if finish_reason is not None:
            split = self._close(split)
        if split.text or split.reasoning or split.calls or entries:
            self._emit(Output(split.text, completion_tokens, prompt_tokens, entries, split.calls, self.cached,
                              split.reasoning))
        return self._stopped() if self._stops.stopped else self._result() if self._ended else None

    def replay(self, steps: Iterable[tuple[int, str, str | None]], prompt_tokens: int) -> GenerationResult | None:
        """A resumed request's earlier (token, text, finish reason) steps, as the earlier run fed them:
        the splitter, the stop matcher and the tool parser end up where that run's stood after them.
        Their output went out with that run, so nothing is sent (and no logprobs are computed).
        Returns the result if they ended the request (a stop string, or a last step with a finish reason)."""
        send, top = self._on_output, self._top_logprobs
        self._on_output, self._top_logprobs = _discard, -1
        try:
            for count, (token, text, finish_reason) in enumerate(steps, 1):
                if (result := self.step(text, token, None, prompt_tokens, count, finish_reason)) is not None:
                    return result
            return None
        finally:
            self._on_output, self._top_logprobs, self._tokens = send, top, []

    def cancelled(self) -> GenerationResult:
        return GenerationResult("cancelled", self.prompt_tokens, self.completion_tokens, cached_tokens=self.cached,
                                draft_tokens=self.draft_tokens)

    def finish(self) -> GenerationResult:
        """The engine ended the request (EOS or max_tokens): what the tool parser and stop strings held
        back, unless the step that said so sent it already."""
        if not self._ended:
            split = self._close(Split("", "", []))
            if split.text or split.reasoning or split.calls:
                self._emit(Output(split.text, self.completion_tokens, self.prompt_tokens, [], split.calls, self.cached,
                                  split.reasoning))
        return self._stopped() if self._stops.stopped else self._result()

    def _close(self, split: Split) -> Split:
        """`split` and, after it, what the splitter and the stop matcher held back at the end."""
        self._ended = True
        if self._stops.stopped:
            return split
        end = self._splitter.finish(self.finish_reason)
        text = self._stops.feed(end.text)
        text += "" if self._stops.stopped else self._stops.flush()
        return Split(split.text + text, split.reasoning + end.reasoning, split.calls + end.calls)

    def _emit(self, output: Output) -> None:
        output.tokens, self._tokens = self._tokens, []
        self._on_output(output)

    def _result(self) -> GenerationResult:
        return GenerationResult(self.finish_reason, self.prompt_tokens, self.completion_tokens, cached_tokens=self.cached,
                                draft_tokens=self.draft_tokens)

    def _stopped(self) -> GenerationResult:
        return GenerationResult("stop", self.prompt_tokens, self.completion_tokens, self._stops.matched, self.cached,
                                self.draft_tokens)


def _discard(_: Output) -> None:
    pass


class TextStream:
    """Token ids to text exactly as stream_generate streams it (mlx-lm's streaming detokenizer),
    for a run that continues another: the earlier tokens go through first, so the first new
    token's text keeps its leading space and a character split across tokens comes out whole.
    (stream_generate's own text starts afresh at the first token it generates.)"""

    def __init__(self, tokenizer: Any) -> None:
        self._detokenizer = tokenizer.detokenizer  # a fresh copy, reset

    def add(self, token: int, finish_reason: str | None = None) -> str:
        """The text `token` completes; with a finish reason, everything still held (as stream_generate's last)."""
        if finish_reason != "stop":  # "stop": an EOS, which stream_generate does not detokenize
            self._detokenizer.add_token(token)
        return self.finish() if finish_reason is not None else self._detokenizer.last_segment

    def finish(self) -> str:
        self._detokenizer.finalize()
        text: str = self._detokenizer.last_segment
        return text
