"""The one request path into the cluster for text generation, shared by every API surface.

`start_generation` queues a request; `resume_generation` attaches to one already under way
(or done) and replays its text from JetStream. Both give a `Generation` to iterate (or to
gather whole: exo/api/collect.py).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager, nullcontext

import msgspec

from exo.api.auth import current_grant
from exo.api.context import ApiContext
from exo.api.errors import ApiError
from exo.api.loading import LoadingWait
from exo.api.outcomes import new_command_id, raise_if_rejected
from exo.api.validate import check_limits
from exo.bus.command_queue import send_command
from exo.bus.readers import read_anywhere
from exo.bus.readiness import NoQuorum
from exo.bus.token_stream import TokenListener, UndecodableChunk, stored_chunks
from exo.core.commands import CancelTask, GenerateText
from exo.core.events import AnyEvent, CommandRejected, TaskFinished
from exo.core.ids import CommandId, ModelId, TaskId
from exo.core.requests import FinishReason, GenerationParams, TokenChunk
from exo.telemetry import tracing

log = logging.getLogger(__name__)


# A task can end without a last chunk from its runner (its instance was deleted before it
# ran); once State says it ended, the chunk that may still be in flight gets this long.
TASK_END_GRACE_S = 1.0
# How long a generation whose client was told it failed is watched, to cancel it if decided late
# (an outage of the event log that long leaves it to run; the watch is this node's memory only).
ABANDONED_WATCH_S = 3600.0


class Generation:
    """A running generation: iterate its chunks; `close()` cancels it if it has not finished."""

    def __init__(self, ctx: ApiContext, command_id: CommandId, listener: TokenListener,
                 ended: asyncio.Future[TaskFinished], after: int = -1) -> None:
        self.command_id = command_id
        self._ctx = ctx
        self._listener = listener
        self._ended = ended
        self._after = after  # chunks up to this index were delivered before (a resumed stream)
        self._started = time.perf_counter()
        self._last_at: float | None = None
        self._tokens_seen = 0
        self._next_index = 0  # the index of the next chunk this generation should see
        self._runs = RunTracker()
        self._loading = LoadingWait(ctx, command_id)
        self.failure: ApiError | None = None  # why it ended before its first chunk, when not a plain error (collect)
        self.finished = False
        self._reading = True
        ctx.readers[command_id] += 1

    async def chunks(self) -> AsyncIterator[TokenChunk]:
        while not self.finished:
            arrived = await self._next_chunk()
            if not self._of_current_run(arrived):
                continue
            for chunk in await self._in_order(arrived):
                if chunk.finish_reason is None and chunk.index <= self._after:
                    continue
                chunk = self._why_cancelled(self._runs.trimmed(chunk))
                if chunk.finish_reason == "error" and self.failure is None and self._last_at is None and self._after < 0:
                    chunk = await self._why_placement_failed(chunk)
                self.finished = chunk.finish_reason is not None
                if isinstance(chunk, UndecodableChunk):  # the runner goes on, but what it sends cannot be read
                    self._ctx.in_background(cancel_generation(self._ctx, self.command_id))
                self._measure(chunk)
                yield chunk
                if self.finished:
                    break

    def _why_cancelled(self, chunk: TokenChunk) -> TokenChunk:
        """A runner's last chunk of a cancelled generation says nothing of why: State does when it
        was not its client's asking (its key was deleted)."""
        if chunk.finish_reason != "cancelled" or chunk.error:
            return chunk
        task = self._ctx.view.state.tasks.get(self.command_id)
        return msgspec.structs.replace(chunk, error=task.cancel_reason) if task and task.cancel_reason else chunk

    async def _why_placement_failed(self, chunk: TokenChunk) -> TokenChunk:
        """An error before the first chunk because its instance's runner failed (a download that
        failed): the failed placement's reason, and its 424 for the surfaces that answer whole."""
        self.failure = await self._loading.failed_placement(self._ended, TASK_END_GRACE_S)
        return chunk if self.failure is None else msgspec.structs.replace(chunk, error=self.failure.message)

    def _waited_out(self, why: str) -> TokenChunk:
        """Its instance was not ready within EXO_LOAD_TIMEOUT_S: it ends here, with why (a 504)."""
        self.failure = ApiError(504, why)
        self._ctx.in_background(cancel_generation(self._ctx, self.command_id))
        return TokenChunk(command_id=self.command_id, index=-1, finish_reason="error", error=why)

    def _of_current_run(self, chunk: TokenChunk) -> bool:
        """A chunk of the task's latest run (a migration starts a new one: exo/master/heal.py); an
        earlier run's late chunk (its node paused, then woke) is dropped. The first chunk of a new
        run may repeat indices this stream already gave (sent, but never stored): their text is
        skipped once (RunTracker), so nothing is repeated."""
        task = self._ctx.view.state.tasks.get(self.command_id)
        if chunk.index < 0 or (task is None or not task.migrations) and not chunk.attempt and not self._runs.attempt:
            return True  # the common case: a task never moved
        current = max(self._runs.attempt, len(task.migrations) if task is not None else 0)
        if chunk.attempt == self._runs.attempt and chunk.attempt >= current:
            return True
        if chunk.attempt < current:
            return False
        self._next_index = self._runs.begin(chunk.attempt, chunk.index, self._next_index)
        return True

    async def _in_order(self, chunk: TokenChunk) -> list[TokenChunk]:
        """`chunk`, after the chunks before it that never reached this listener (a dropped
        connection loses plain NATS messages): those come from JetStream, and if JetStream does
        not have them either, the generation ends with an error rather than with text missing."""
        # The task ended and its last chunk did not come: look in the stream first (unless the wait
        # for its model ended it here: nothing was generated, and the cancel's chunk may be there).
        if chunk.index < 0 and self.failure is None:
            found = await self._stored(self._next_index, None)
            stored = [found[i] for i in sorted(found)]
            if stored and stored[-1].finish_reason is not None and len(stored) == stored[-1].index + 1 - self._next_index:
                self._next_index = stored[-1].index + 1
                return stored
            return [chunk]
        if chunk.index < self._next_index:
            # A duplicate, unless it ends the generation: the worker ends a task whose runner died
            # with a last chunk of index 0, whatever the runner had sent.
            return [chunk] if chunk.finish_reason is not None else []
        missing = range(self._next_index, chunk.index)
        self._next_index = chunk.index + 1
        if not missing:
            return [chunk]
        found = await self._stored(missing.start, missing.stop)
        recovered = list(itertools.takewhile(lambda c: c is not None, (found[i] for i in missing if i in found)))
        if len(recovered) == len(missing):
            log.info("generation %s: %d chunks recovered from JetStream", self.command_id, len(missing))
            return [*recovered, chunk]
        lost = len(missing) - len(recovered)
        log.warning("generation %s: %d chunks of its text are lost", self.command_id, lost)
        self._ctx.in_background(cancel_generation(self._ctx, self.command_id))
        return [*recovered, TokenChunk(command_id=self.command_id, index=chunk.index, finish_reason="error",
                                       error=f"{lost} chunks of this generation's text were lost in transit (a NATS "
                                             f"server restarted?) and are not in JetStream; the text would be incomplete")]

    async def _stored(self, first: int, stop: int | None) -> dict[int, TokenChunk]:
        try:
            found = await stored_chunks(self._ctx.nc, self.command_id, first, stop, gate=self._listener.gate)
        except Exception as error:  # JetStream unreachable right now: what is missing stays missing
            log.warning("generation %s: cannot read its chunks from JetStream: %r", self.command_id, error)
            return {}
        # An earlier run's chunks past where the current run took over (a paused node's late ones) are not its text.
        task = self._ctx.view.state.tasks.get(self.command_id)
        current = max(self._runs.attempt, len(task.migrations) if task is not None else 0)
        start = self._runs.start if self._runs.attempt == current else self._next_index
        return {i: c for i, c in found.items() if c.attempt >= current or i < start}

    def _measure(self, chunk: TokenChunk) -> None:
        metrics, now = self._ctx.metrics, time.perf_counter()
        new_tokens = max(0, chunk.token_count - self._tokens_seen)
        if self._after >= 0:
            return  # a resumption: the first stream measured this generation
        if chunk.finish_reason is not None:
            metrics.count_tokens(chunk.prompt_tokens, chunk.token_count, chunk.cached_tokens, chunk.draft_tokens)
        elif self._last_at is None:
            metrics.ttft.observe(now - self._started)
        elif new_tokens:
            for _ in range(new_tokens):  # a chunk carries every token since the last one
                metrics.inter_token.observe((now - self._last_at) / new_tokens)
        if chunk.finish_reason is None:
            self._last_at, self._tokens_seen = now, chunk.token_count

    def tell_loading(self, send: Callable[[str], Awaitable[None]]) -> None:
        """Until its first chunk, every EXO_LOADING_NOTE_S the stream is told (`send`) what the
        generation waits for, while its model loads or waits for room: a client is never left in silence."""
        self._loading.note = send

    async def _next_chunk(self) -> TokenChunk:
        queue = self._listener.queue
        if not queue.empty() or not self._ended.done():
            getter = asyncio.ensure_future(queue.get())
            try:
                why = await self._loading.wait({getter, self._ended}, first=self._last_at is None)  # type: ignore[arg-type]
            except BaseException:  # the client left while told of the loading: stop reading for it
                getter.cancel()
                raise
            if getter.done():
                return getter.result()
            getter.cancel()
            if why:
                return self._waited_out(why)
        try:
            return await asyncio.wait_for(queue.get(), TASK_END_GRACE_S)
        except TimeoutError:
            end = self._ended.result()
            if end.status == "completed":  # its text is gone (EXO_TOKENS keeps it ten minutes)
                reason = end.finish_reason if end.finish_reason in ("stop", "length") else "stop"
                return TokenChunk(command_id=self.command_id, index=-1, finish_reason=reason,  # type: ignore[arg-type]
                                  prompt_tokens=end.prompt_tokens, token_count=end.completion_tokens,
                                  cached_tokens=end.cached_tokens)
            failed: FinishReason = "error" if end.status == "failed" else "cancelled"
            return TokenChunk(command_id=self.command_id, index=-1, finish_reason=failed, error=end.error or f"task {end.status}")

    async def close(self, resume_grace_s: float = 0.0) -> None:
        """Stop listening. An unfinished generation is cancelled, at once or, for a stream
        its client may resume, after `resume_grace_s` unless a resumption claims it."""
        self._ctx.outcomes.forget_task_end(self.command_id, self._ended)
        await self._listener.close()
        self._stop_reading()
        if self.finished:
            return
        if resume_grace_s > 0:
            ctx, command_id = self._ctx, self.command_id
            if (earlier := ctx.pending_cancels.pop(command_id, None)) is not None:
                earlier.cancel()  # the grace starts again from the last reader to leave
            ctx.pending_cancels[command_id] = asyncio.get_running_loop().call_later(
                resume_grace_s, lambda: ctx.in_background(_cancel_if_unread(ctx, command_id)))
            return
        await asyncio.shield(cancel_generation(self._ctx, self.command_id))

    def _stop_reading(self) -> None:
        if self._reading:
            self._reading = False
            readers = self._ctx.readers
            readers[self.command_id] -= 1
            if readers[self.command_id] <= 0:
                del readers[self.command_id]


class RunTracker:
    """What this stream gave of each chunk index (lengths), so that a new run of the task (a
    migration) that resumes at an index the stream already gave skips that much of its text."""

    KEPT = 4096  # indices remembered: a run resumes at most a few chunks back (what was never stored)

    def __init__(self) -> None:
        self.attempt = 0
        self.start = 0  # the index the current run began at
        self._given: dict[int, tuple[int, int, int]] = {}  # index -> (text, reasoning, logprobs) given
        self._skip = [0, 0, 0]

    def begin(self, attempt: int, first_index: int, next_index: int) -> int:
        """Run `attempt` starts at `first_index`; returns the index this stream now expects next."""
        self.attempt, self.start = attempt, first_index
        repeated = [self._given[i] for i in range(first_index, next_index) if i in self._given]
        self._skip = [sum(given[k] for given in repeated) for k in range(3)]
        if repeated:
            log.info("generation resumes %d chunk(s) back after a migration; skipping what was given",
                     len(repeated))
        return min(first_index, next_index)

    def trimmed(self, chunk: TokenChunk) -> TokenChunk:
        text, reasoning, logprobs = chunk.text, chunk.reasoning, chunk.logprobs
        if any(self._skip):
            cut = [min(self._skip[0], len(text)), min(self._skip[1], len(reasoning)), min(self._skip[2], len(logprobs))]
            text, reasoning, logprobs = text[cut[0]:], reasoning[cut[1]:], logprobs[cut[2]:]
            self._skip = [left - done for left, done in zip(self._skip, cut, strict=True)]
            chunk = msgspec.structs.replace(chunk, text=text, reasoning=reasoning, logprobs=logprobs)
        if chunk.index >= 0:
            self._given[chunk.index] = (len(text), len(reasoning), len(logprobs))
            self._given.pop(chunk.index - self.KEPT, None)
        return chunk


async def _cancel_if_unread(ctx: ApiContext, command_id: CommandId) -> None:
    """The grace is over: cancel the generation unless a client reads it on this or another API node."""
    ctx.pending_cancels.pop(command_id, None)
    if ctx.readers[command_id] > 0 or await read_anywhere(ctx.nc, command_id):
        return  # that reader's node starts the grace again when it leaves
    await cancel_generation(ctx, command_id)


async def cancel_generation(ctx: ApiContext, command_id: CommandId) -> None:
    """Ask the master to stop a generation; the runner stops within one decode step."""
    ctx.pending_cancels.pop(command_id, None)
    await send_command(ctx.nc, CancelTask(command_id=new_command_id(), task_id=command_id),
                       ctx.view.names_for_task(TaskId(command_id)))


async def _cancel_once_decided(ctx: ApiContext, command_id: CommandId, answer: asyncio.Future[AnyEvent]) -> None:
    """Its client was answered 503 or 504, but the command stays queued and is decided once the
    master can append again: cancel it then, so the client's retry is the only run."""
    try:
        event = await asyncio.wait_for(answer, ABANDONED_WATCH_S)
    except TimeoutError:
        return
    finally:
        ctx.outcomes.forget(command_id, answer)
    if not isinstance(event, CommandRejected):
        await cancel_generation(ctx, command_id)


async def start_generation(ctx: ApiContext, model_id: ModelId, params: GenerationParams,
                           tier: str = "interactive", keep_alive_s: float | None = None) -> Generation:
    """Queue the request and return once the master accepted it (or raise why it did not).
    `tier`: the request's own ("batch" lowers it; it cannot raise its key's); `keep_alive_s`: how
    long its model stays loaded after it (exo/api/keep_alive.py; None: as its desire says)."""
    card = ctx.card(model_id)
    grant = current_grant.get()
    # The context placed instances have room for, else the model's own (none placed: a 503 follows).
    check_limits(params, ctx.view.state.max_context_of(model_id) or (card.context_length if card is not None else 0),
                 ctx.settings.max_tokens_limit)
    command_id = new_command_id()
    names = ctx.view.names_for_model(model_id)
    await ctx.outcomes.raise_if_no_quorum(names)  # nothing is queued that could run after its client's 503
    listener = await TokenListener.live(ctx.nc, command_id, ctx.chunk_gate)  # before sending: no chunk can be missed
    answer = ctx.outcomes.expect(command_id)
    ended = ctx.outcomes.expect_task_end(command_id)
    try:
        key = grant.key
        await send_command(ctx.nc, GenerateText(command_id=command_id, model_id=model_id, params=params, at=time.time(),
                                                key_id=key.key_id if key else "",
                                                priority="batch" if "batch" in (tier, key.priority if key else "")
                                                else "interactive", keep_alive_s=keep_alive_s), names)
        raise_if_rejected(await ctx.outcomes.answer(answer, names))
    except (TimeoutError, NoQuorum) as error:
        ctx.in_background(_cancel_once_decided(ctx, command_id, ctx.outcomes.expect(command_id)))
        ctx.outcomes.forget_task_end(command_id, ended)
        await listener.close()
        if isinstance(error, NoQuorum):
            raise
        raise ApiError(504, "the master did not answer in time; is it running?") from None
    except BaseException:
        ctx.outcomes.forget_task_end(command_id, ended)
        await listener.close()
        raise
    finally:
        ctx.outcomes.forget(command_id, answer)
    return Generation(ctx, command_id, listener, ended)


def requested_tier(service_tier: str | None, priority: int | None) -> str:
    """A request's tier: OpenAI's `service_tier: "flex"` or vLLM's `priority` above 0 (lower goes
    first there) ask for the batch tier; anything else keeps the key's."""
    return "batch" if service_tier == "flex" or (priority or 0) > 0 else "interactive"


@asynccontextmanager
async def generating(ctx: ApiContext, model_id: ModelId, params: GenerationParams, missing: ApiError | None = None,
                     resume_grace_s: float = 0.0, storing: AbstractAsyncContextManager[None] | None = None,
                     tier: str = "interactive", keep_alive_s: float | None = None) -> AsyncIterator[Generation]:
    """The one way a surface runs a generation: the model must have a card (else `missing`, the
    surface's own 404, or OpenAI's), the request is queued (inside `storing`: what must be stored
    for it, e.g. its images), and however the handler ends the generation is closed: cancelled if
    unfinished, at once or after `resume_grace_s` for a stream its client may resume."""
    card = ctx.card(model_id)
    if card is None:
        raise missing or ctx.unknown_model(model_id, "model", f"The model {model_id!r} does not exist")
    grant = current_grant.get()
    if not grant.may_use(model_id):
        raise ApiError(403, f"API key {grant.key.key_id if grant.key else ''} may not use the model {model_id!r} "
                            "(its model patterns do not match)", param="model", code="model_not_allowed")
    if card.embedding is not None and params.embed is None:
        use = "POST /v1/rerank" if card.embedding.rerank else "POST /v1/embeddings (or Ollama's /api/embed)"
        raise ApiError(400, f"the model {model_id!r} is an embedding model and does not generate text: use {use}",
                       param="model")
    if card.transcribes and params.transcribe is None:
        raise ApiError(400, f"the model {model_id!r} is a speech-to-text model and does not generate text: use "
                            "POST /v1/audio/transcriptions", param="model")
    if card.speaks and params.speak is None:
        raise ApiError(400, f"the model {model_id!r} is a text-to-speech model and does not generate text: use "
                            "POST /v1/audio/speech", param="model")
    # The request's trace, when tracing is on: every hop after this one is its descendant (exo/telemetry).
    with tracing.root_span("exo.api.generation", attributes={"exo.model": model_id}) as request_span:
        async with storing or nullcontext():
            generation = await start_generation(ctx, model_id, params, tier, keep_alive_s)
        request_span.set("exo.task_id", generation.command_id)
        try:
            yield generation
        finally:
            await generation.close(resume_grace_s)


async def resume_generation(ctx: ApiContext, command_id: CommandId, after: int) -> Generation:
    """The rest of a generation after chunk `after`, replayed from JetStream, then live."""
    task = ctx.view.state.tasks.get(command_id)
    if task is None or not current_grant.get().may_read(task):  # another key's: as if unknown
        raise ApiError(404, f"no generation {command_id!r} (unknown, or finished too long ago)", param="id")
    pending = ctx.pending_cancels.pop(command_id, None)
    if pending is not None:
        pending.cancel()  # its client is back: keep generating
    ended = ctx.outcomes.expect_task_end(command_id)
    if task.status not in ("pending", "running") and not ended.done():
        ended.set_result(TaskFinished(task_id=command_id, status=task.status, finish_reason=task.finish_reason,
                                      error=task.error, prompt_tokens=task.prompt_tokens,
                                      completion_tokens=task.completion_tokens, cached_tokens=task.cached_tokens))
    listener = await TokenListener.from_stream(ctx.nc, command_id, gate=ctx.chunk_gate)
    return Generation(ctx, command_id, listener, ended, after=after)
