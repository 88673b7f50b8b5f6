"""One generation's token chunks, as the runner publishes them on exo.tokens.<command_id>."""

from __future__ import annotations

from exo.core.ids import TaskId
from exo.core.requests import ChoiceEnd, TokenChunk
from exo.runner.choices import ChoiceEnded
from exo.runner.coalesce import Coalescer, Piece
from exo.runner.decoding import GenerationResult, Output
from exo.runner.protocol import Resume
from exo.settings.services import RunnerSettings


class ChunkMaker:
    """One generation's token chunks: its text coalesced (coalesce.py), with the logprobs, tool calls
    and token ids that came with that text. A resumed request (a migration) goes on with the chunk
    index where the earlier run's stopped, and every chunk says which run (attempt) sent it. With
    several choices (n > 1) each choice's text is coalesced apart, and its chunks say which choice
    they carry; they share one sequence of indices, so a reader still sees every chunk in order. A
    choice that ends before the request does gets a chunk of its own then: the rest of its text, and
    its end in `choices`."""

    def __init__(self, task_id: TaskId, resume: Resume | None = None,
                 interval_s: float = RunnerSettings().stream_interval_ms / 1000) -> None:
        self._task_id = task_id
        self.index, self.attempt = (resume.next_index, resume.attempt) if resume is not None else (0, 0)
        self._interval = interval_s  # text faster than this goes out as one message per interval
        self._coalescers: dict[int, Coalescer] = {}  # by choice
        self._held: dict[int, Output] = {}  # by choice: what goes with the text its coalescer holds
        self._told: set[int] = set()  # choices whose end went out before the request's

    def add(self, out: Output, now: float) -> list[TokenChunk]:
        """The chunks to send now (on the model thread)."""
        if isinstance(out, ChoiceEnded):
            self._told.add(out.choice)
            return [self._chunk(self._coalescer_of(out.choice).flush(now), out, [out.end])]
        sent: list[TokenChunk] = []
        coalescer = self._coalescer_of(out.choice)
        ready = coalescer.add(out.text, now, out.reasoning)
        if ready is not None and out.reasoning and not ready.reasoning:
            sent.append(self._chunk(ready, out))  # content held before this output's reasoning: not its ids
            ready = None
        held = self._held_of(out.choice)
        held.logprobs.extend(out.logprobs)
        held.tokens.extend(out.tokens)
        if out.tool_calls:  # a tool call is sent at once, with the text held before it
            if ready:
                sent.append(self._chunk(ready, out))
            self._held_of(out.choice).tool_calls.extend(out.tool_calls)
            ready = coalescer.flush(now)
        if ready or out.tool_calls:
            sent.append(self._chunk(ready, out))
        return sent

    def rest(self, result: GenerationResult, now: float) -> list[TokenChunk]:
        """What is still held once the generation ended, choice by choice (then comes the final chunk, at `index`)."""
        sent = []
        ends = {end.choice: end.completion_tokens for end in result.choices}
        for choice in sorted(self._coalescers):
            rest, held = self._coalescers[choice].flush(now), self._held_of(choice)
            if not rest and not held.logprobs and not held.tokens:
                continue
            end = Output("", ends.get(choice, result.completion_tokens), result.prompt_tokens, [], [], result.cached_tokens)
            end.choice = choice
            sent.append(self._chunk(rest, end))
        return sent

    def untold(self, ends: list[ChoiceEnd]) -> list[ChoiceEnd]:
        """The ends the request's final chunk names: those of the choices that did not end before it
        (each choice's end is in one chunk, so a stream resumed past an early end does not repeat it)."""
        return [end for end in ends if end.choice not in self._told]

    def _coalescer_of(self, choice: int) -> Coalescer:
        if choice not in self._coalescers:
            self._coalescers[choice] = Coalescer(self._interval)
        return self._coalescers[choice]

    def _held_of(self, choice: int) -> Output:
        if choice not in self._held:
            self._held[choice] = Output("", 0, 0, [], [])
        return self._held[choice]

    def _chunk(self, piece: Piece | None, out: Output, ends: list[ChoiceEnd] | None = None) -> TokenChunk:
        held = self._held.pop(out.choice, None) or Output("", 0, 0, [], [])
        text, reasoning = piece or ("", "")
        self.index += 1
        return TokenChunk(command_id=self._task_id, index=self.index - 1, text=text, reasoning=reasoning,
                          token_count=out.completion_tokens, prompt_tokens=out.prompt_tokens, logprobs=held.logprobs,
                          tool_calls=held.tool_calls, cached_tokens=out.cached_tokens, token_ids=held.tokens,
                          attempt=self.attempt, choice=out.choice, choices=ends or [])
