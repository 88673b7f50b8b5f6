"""Several choices from one request (OpenAI's `n`, and `best_of` on completions): their bounds, and
each choice collected from the generation's chunks (each chunk says its choice; the last one says
how the choices still decoding ended: one that ended before the others said so in a chunk of its
own, where its stream ends it). The runner generates them from one prefill (exo/runner/choices.py)."""

from __future__ import annotations

from exo.api.collect import Collected, raise_if_failed
from exo.api.errors import ApiError
from exo.api.generation import Generation
from exo.api.validate import in_range
from exo.core.requests import ChoiceEnd, FinishReason, TokenChunk

MAX_CHOICES = 16  # rows of the batch one request may take


def check_n(n: int) -> int:
    in_range(n, 1, MAX_CHOICES, "n")
    return n


def check_best_of(best_of: int | None, n: int, stream: bool) -> int:
    """The candidates to generate beyond n (0: none, best_of equal to n is plain n)."""
    if best_of is None or best_of == n:
        return 0
    if not n <= best_of <= MAX_CHOICES:
        raise ApiError(400, f"best_of must be between n ({n}) and {MAX_CHOICES}, got {best_of}", param="best_of")
    if stream:
        raise ApiError(400, "best_of cannot be streamed: the candidates are ranked once they have all ended "
                            "(as OpenAI's API says)", param="best_of")
    return best_of


async def collect_choices(generation: Generation) -> list[Collected]:
    """Every choice's text, reasoning, tool calls and logprobs, in choice order, each with the last
    chunk (usage) and its own end; a failed or cancelled generation becomes an ApiError."""
    parts: dict[int, tuple[Collected, list[str], list[str]]] = {}
    ends: dict[int, ChoiceEnd] = {}
    final = None
    async for chunk in generation.chunks():
        ends.update((end.choice, end) for end in chunk.choices)
        collected, text, reasoning = parts.setdefault(chunk.choice, (Collected(), [], []))
        text.append(chunk.text)
        reasoning.append(chunk.reasoning)
        collected.tool_calls.extend(chunk.tool_calls)
        collected.logprobs.extend(chunk.logprobs)
        raise_if_failed(chunk, generation.failure)
        final = chunk if chunk.finish_reason else final
    if final is None:
        raise ApiError(500, "generation ended without a finish reason")
    choices = []
    for choice in range(max(len(ends), 1)):
        collected, text, reasoning = parts.get(choice, (Collected(), [], []))
        collected.text, collected.reasoning, collected.final = "".join(text), "".join(reasoning), final
        collected.end = ends.get(choice)
        choices.append(collected)
    return choices


def likeliest(candidates: list[Collected], n: int) -> list[Collected]:
    """best_of: the n candidates of the highest cumulative logprob (the sum over their tokens), likeliest first."""
    return sorted(candidates, key=lambda c: -(c.end.logprob if c.end is not None else 0.0))[:n]


def newly_ended(chunk: TokenChunk, ended: set[int]) -> list[tuple[int, FinishReason]]:
    """The choices whose stream ends at `chunk`, each once (`ended`: those already ended): a choice that
    ended before the others, in its last chunk; the rest in the request's final chunk (n=1: choice 0)."""
    ends = [(end.choice, end.finish_reason) for end in chunk.choices]
    if chunk.finish_reason is not None and not ends:
        ends = [(0, chunk.finish_reason)]
    fresh = [(choice, reason) for choice, reason in ends if choice not in ended]
    ended.update(choice for choice, _ in fresh)
    return fresh
