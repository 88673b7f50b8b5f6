"""A request's several choices (OpenAI's `n`, and completions' `best_of` candidates) in the batch.

The prompt is prefilled once: the first row goes in as any request does, and when mlx-lm has
processed all of its prompt but the last token (the end of its first segment), the other rows join
with that row's KV cache and only the last token to process (batch.py, `Batcher._fan_out`). Each
row then decodes on its own: its sampler (with a seed, choice i draws what `mx.random.seed(seed + i)`
then mlx-lm's sampler would, so greedy choices are all the same, as in vLLM and OpenAI), its stop
strings, tool parser and logprobs. A row that ends before the others says so at once (a
`ChoiceEnded` output: its stream gets that choice's finish chunk there, as OpenAI's and vLLM's
do); the request ends once every row has, with one result that says how each ended; a row that
fails ends the request and stops the others.

Only the batch does this. The single path (a multi-node instance, a quantized KV cache, a draft
model, images, EXO_MAX_BATCH=1) refuses n > 1, and a migrated request of several choices is not
continued: the streamed tokens of its choices are not kept apart for a resume.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, cast

from exo.core.requests import ChoiceEnd, FinishReason, GenerationParams, rows_of
from exo.runner.decoding import GenerationResult, OnOutput, Output, RequestRefused

if TYPE_CHECKING:
    from exo.runner.batch import Job

Outcome = GenerationResult | BaseException
SEEDS = 2**64  # mx.random.seed takes an unsigned 64-bit integer: seed + i wraps around


def row_seed(seed: int, choice: int) -> int:
    return (seed + choice) % SEEDS


def ranks_candidates(params: GenerationParams) -> bool:
    """Whether its rows' cumulative logprobs are wanted (best_of picks the likeliest n)."""
    return params.best_of > params.n


class ChoicesNotResumable(RuntimeError):
    """A migrated request of several choices: it fails rather than continue with mixed-up text."""


def refusal(resumed: bool) -> Exception:
    """Why the single path does not run a request of several choices."""
    if resumed:
        return ChoicesNotResumable("a generation of n > 1 choices cannot be continued on another instance: "
                                   "the tokens its choices streamed are not kept apart for a resume")
    return RequestRefused("n > 1 (or best_of) needs batched decoding, and this instance runs requests one at a time "
                          "(a multi-node instance, a quantized KV cache, a draft model, images, or EXO_MAX_BATCH=1): "
                          "send n=1")


class ChoiceEnded(Output):
    """A choice that ended while others of its request decode: ChunkMaker sends what it still holds
    of that choice with `end` (the request's last chunk names the last choices' ends)."""

    def __init__(self, end: ChoiceEnd, result: GenerationResult) -> None:
        super().__init__("", end.completion_tokens, result.prompt_tokens, [], [], result.cached_tokens)
        self.choice = end.choice
        self.end = end


class Choices:
    """The rows of one request, on the model thread: collects their ends and reports the request's."""

    def __init__(self, rows: int, on_done: Callable[[Outcome], None], on_output: OnOutput) -> None:
        self.rows = rows
        self._on_done = on_done
        self._on_output = on_output
        self._ended: dict[int, tuple[GenerationResult, float]] = {}
        self.over = False  # every row ended, or one failed: the others stop and send nothing more
        self.fanned_out = False  # the rows after the first joined the batch

    def row_done(self, choice: int, outcome: Outcome, logprob: float = 0.0) -> None:
        if self.over:
            return
        if isinstance(outcome, BaseException) or not self.fanned_out:  # a failure; or it ended before the others began
            self.over = True
            self._on_done(outcome)
            return
        self._ended[choice] = (outcome, logprob)
        if len(self._ended) == self.rows:
            self.over = True
            self._on_done(merged([self._ended[i] for i in range(self.rows)]))
        elif outcome.finish_reason != "cancelled":  # the rows are cancelled together: the request's end says so
            self._on_output(ChoiceEnded(choice_end(choice, outcome, logprob), outcome))


def choice_end(choice: int, result: GenerationResult, logprob: float) -> ChoiceEnd:
    return ChoiceEnd(choice=choice, finish_reason=cast(FinishReason, result.finish_reason),
                     completion_tokens=result.completion_tokens, stop_sequence=result.stop_sequence, logprob=logprob)


def merged(ends: list[tuple[GenerationResult, float]]) -> GenerationResult:
    """One result for the request: the prompt counted once, the completion tokens of every row summed,
    and each row's end (ChoiceEnd). Cancelled if any row was (they are cancelled together)."""
    first = ends[0][0]
    reason = "cancelled" if any(r.finish_reason == "cancelled" for r, _ in ends) else first.finish_reason
    result = GenerationResult(reason, first.prompt_tokens, sum(r.completion_tokens for r, _ in ends),
                              first.stop_sequence, first.cached_tokens)
    result.choices = [choice_end(i, r, logprob) for i, (r, logprob) in enumerate(ends)]
    return result


def first_of_choices(job: Job) -> None:
    """`job` (just made for its request) becomes the first of its rows: the request ends once every
    row has, and a row that fails stops the others (and what they would still send)."""
    output, cancelled = job.on_output, job.is_cancelled
    choices = Choices(rows_of(job.params), job.on_done, output)
    job.choices = choices
    job.on_done = lambda outcome: choices.row_done(0, outcome, job.logprob)
    job.on_output = lambda out: None if choices.over else output(out)
    job.is_cancelled = lambda: choices.over or cancelled()


def sibling(first: Job, choice: int) -> Job:
    """Choice `choice` of `first`'s request: the same prompt and budget, a decoding of its own."""
    assert first.choices is not None
    choices = first.choices
    row = type(first)(first.params, first.defaults, first.on_output, first.is_cancelled, first.task_id, first.on_done)
    row.tokens, row.max_tokens, row.choice, row.choices = first.tokens, first.max_tokens, choice, choices
    row.on_done = lambda outcome: choices.row_done(choice, outcome, row.logprob)
    return row
