"""How a generation's end becomes an answer: `collect` gathers a whole generation for the surfaces
that answer in one piece, and `raise_if_failed` turns a failed or cancelled one into the ApiError
every surface (streaming or not) answers with.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from exo.api.errors import ApiError
from exo.api.generation import Generation
from exo.core.requests import ChoiceEnd, TokenChunk, TokenLogprob, ToolCall


@dataclass
class Collected:
    """A whole generation, for the surfaces that answer in one piece."""

    text: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    final: TokenChunk | None = None
    end: ChoiceEnd | None = None  # with several choices: how this one ended (exo/api/choices.py)

    @property
    def finish_reason(self) -> str:
        assert self.final is not None and self.final.finish_reason is not None
        reason = self.end.finish_reason if self.end is not None else self.final.finish_reason
        if self.tool_calls and reason == "stop":
            return "tool_calls"
        return reason


async def collect(generation: Generation) -> Collected:
    """Every chunk until the last; a failed or cancelled generation becomes an ApiError."""
    collected, text, reasoning = Collected(), [], []
    async for chunk in generation.chunks():
        text.append(chunk.text)
        reasoning.append(chunk.reasoning)
        collected.tool_calls.extend(chunk.tool_calls)
        collected.logprobs.extend(chunk.logprobs)
        raise_if_failed(chunk, generation.failure)
        if chunk.finish_reason:
            collected.final = chunk
    if collected.final is None:
        raise ApiError(500, "generation ended without a finish reason")
    collected.text = "".join(text)
    collected.reasoning = "".join(reasoning)
    return collected


def raise_if_failed(chunk: TokenChunk, failure: ApiError | None = None) -> None:
    """`failure`: the generation's, when its wait for its model went wrong (Generation.failure)."""
    if chunk.finish_reason == "error" and failure is not None:
        raise failure
    if chunk.finish_reason == "error" and chunk.error_code:  # refused by the runner before any work
        param = "messages" if chunk.error_code == "context_length_exceeded" else None
        raise ApiError(400, chunk.error, param=param, code=chunk.error_code)
    if chunk.finish_reason == "error":
        raise ApiError(500, chunk.error or "generation failed")
    if chunk.finish_reason == "cancelled":
        raise ApiError(503, chunk.error or "generation was cancelled")
