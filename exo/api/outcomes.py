"""Answers to commands: the API waits for the first event that names its command id."""

from __future__ import annotations

import asyncio
import math
import uuid
from collections.abc import Callable
from typing import TypeVar

from exo.api.errors import STATUS_FOR_REJECTION, ApiError
from exo.bus.command_queue import send_command
from exo.bus.connection import Connection
from exo.bus.readiness import PROBE_CACHE_S, NoQuorum, StreamProbe
from exo.bus.state_view import FoldedView
from exo.bus.subjects import SHARED, LogNames
from exo.core.apply import was_skipped
from exo.core.commands import Command
from exo.core.events import AnyEvent, CommandRejected, TaskFinished, command_id_of
from exo.core.ids import CommandId, TaskId
from exo.core.state import State

COMMAND_TIMEOUT_S = 30.0
QUORUM_CHECK_S = PROBE_CACHE_S  # while an answer is awaited, how often the log's quorum is asked about

T = TypeVar("T")


def new_command_id() -> CommandId:
    """A fresh id for a command this API sends (the pure core takes ids in, never makes them)."""
    return CommandId(uuid.uuid4().hex)


class CommandOutcomes:
    def __init__(self, nc: Connection, view: FoldedView) -> None:
        self._nc = nc
        # Several callers may wait for one command (a retried Idempotency-Key): each has its own future.
        self._waiters: dict[str, list[asyncio.Future[AnyEvent]]] = {}
        self._task_ends: dict[str, list[asyncio.Future[TaskFinished]]] = {}
        self._watches: list[tuple[Callable[[State], object], asyncio.Future[object]]] = []
        self._view = view
        self._probes: dict[str, StreamProbe] = {}  # events stream -> its readiness, asked at most once a moment
        view.add_listener(self._on_event)

    def expect(self, command_id: CommandId) -> asyncio.Future[AnyEvent]:
        """Register before sending, so an answer that comes fast is not missed."""
        future = asyncio.get_running_loop().create_future()
        self._waiters.setdefault(command_id, []).append(future)
        return future

    def forget(self, command_id: CommandId, future: asyncio.Future[AnyEvent] | None = None) -> None:
        """Stop waiting: this caller's future only, or (None) every waiter of the command."""
        waiting = [f for f in self._waiters.pop(command_id, []) if future is not None and f is not future]
        if waiting:
            self._waiters[command_id] = waiting

    def expect_task_end(self, task_id: TaskId) -> asyncio.Future[TaskFinished]:
        """Resolves when State says the task ended, whoever ended it (runner, master, worker).
        Several callers may wait on one task (a stream and its resumption)."""
        future = asyncio.get_running_loop().create_future()
        self._task_ends.setdefault(task_id, []).append(future)
        return future

    def forget_task_end(self, task_id: TaskId, future: asyncio.Future[TaskFinished] | None = None) -> None:
        waiting = [f for f in self._task_ends.pop(task_id, []) if future is not None and f is not future]
        if waiting:
            self._task_ends[task_id] = waiting

    async def until(self, check: Callable[[State], T | None], timeout: float) -> T | None:
        """The first answer of `check` that is not None, on State now and then after each event
        folded in; None when `timeout` seconds pass first. `check` must be quick and pure."""
        found = check(self._view.state)
        if found is not None:
            return found
        watch = (check, asyncio.get_running_loop().create_future())
        self._watches.append(watch)
        try:
            return await asyncio.wait_for(watch[1], timeout)
        except TimeoutError:
            return None
        finally:
            self._watches.remove(watch)

    async def raise_if_no_quorum(self, names: LogNames = SHARED) -> None:
        """NoQuorum (the API answers 503 + Retry-After) while the event log the command's answer goes
        to has lost its quorum: the master could take the command but append nothing until servers
        return. A leader election among a majority is no reason: it ends within seconds."""
        probe = self._probes.setdefault(names.events_stream, StreamProbe(self._nc, names.events_stream))
        if problem := await probe.lost_quorum():
            raise NoQuorum(problem)

    async def answer(self, future: asyncio.Future[AnyEvent], names: LogNames = SHARED) -> AnyEvent:
        """The event `future` (from `expect`) gets; TimeoutError after COMMAND_TIMEOUT_S, NoQuorum as
        soon as the log has lost its quorum (the command stays queued: it may be decided once it has)."""
        deadline = asyncio.get_running_loop().time() + COMMAND_TIMEOUT_S
        while (left := deadline - asyncio.get_running_loop().time()) > 0:
            done, _ = await asyncio.wait({future}, timeout=min(left, QUORUM_CHECK_S))
            if done:
                return future.result()
            await self.raise_if_no_quorum(names)
        raise TimeoutError

    async def call(self, command: Command) -> AnyEvent:
        """Send a command and return the event that answers it; a rejection becomes an ApiError."""
        await self.raise_if_no_quorum()
        future = self.expect(command.command_id)
        try:
            await send_command(self._nc, command)
            event = await self.answer(future)
        except TimeoutError:
            raise ApiError(504, "the master did not answer in time; is it running?") from None
        finally:
            self.forget(command.command_id, future)
        raise_if_rejected(event)
        return event

    def _on_event(self, seq: int, event: AnyEvent, state: State) -> None:
        if was_skipped(state, seq):
            # Not an answer: e.g. a deposed master's decision fenced off by its old term (the
            # new master decides the command again) or a stray publisher's event.
            return
        for future in self._waiters.get(command_id_of(event), []):
            if not future.done():
                future.set_result(event)
        if isinstance(event, TaskFinished):
            for ended in self._task_ends.get(event.task_id, []):
                if not ended.done():
                    ended.set_result(event)
        for check, watching in self._watches:
            if not watching.done():
                found = check(state)
                if found is not None:
                    watching.set_result(found)


# What a client told "overloaded" should wait before it tries again.
RETRY_AFTER_S = 1


def raise_if_rejected(event: AnyEvent) -> None:
    if isinstance(event, CommandRejected):
        headers = {"Retry-After": str(RETRY_AFTER_S)} if event.code == "overloaded" else None
        if event.code == "rate_limited":  # whole seconds, rounded up: a client that waits that long is let in
            headers = {"Retry-After": str(max(1, math.ceil(event.retry_after_s)))}
        raise ApiError(STATUS_FOR_REJECTION[event.code], event.reason, code=event.code, headers=headers)
