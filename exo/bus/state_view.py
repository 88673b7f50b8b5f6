"""A node's live copy of State: follows the event log and folds each event in with `apply`."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Protocol

from nats.aio.client import Client

from exo.bus.event_log import EventFollower
from exo.bus.subjects import SHARED, LogNames
from exo.core.apply import apply, skip_event
from exo.core.event_signers import SignatureCheck
from exo.core.events import AnyEvent
from exo.core.ids import TaskId
from exo.core.state import State

log = logging.getLogger(__name__)

Listener = Callable[[int, AnyEvent, State], Awaitable[None] | None]


class FoldedView(Protocol):
    """What API nodes and workers read: a StateView, or a ClusterView (exo/bus/cluster_view.py)."""

    @property
    def state(self) -> State: ...

    def add_listener(self, listener: Listener) -> None: ...

    def names_for_model(self, model_id: str) -> LogNames:
        """Where a command about the model goes: its master group's log, or the shared one."""
        ...

    def names_for_task(self, task_id: TaskId) -> LogNames:
        """The log holding the task: its cancel and its events go there."""
        ...


class StateView:
    def __init__(self, nc: Client, initial: State | None = None, names: LogNames = SHARED) -> None:
        self.names = names
        self.state = initial or State(group=names.group)
        self._listeners: list[Listener] = []
        self._advanced = asyncio.Condition()
        self._follower = EventFollower(nc, self._on_event, self._on_undecodable, names)

    def add_listener(self, listener: Listener) -> None:
        """Called after each event is folded in, with the new State. Listeners run on the
        follower's delivery path, one event at a time: one that is slow holds up every later
        event for this whole node, so keep them O(1) per event."""
        self._listeners.append(listener)

    async def start(self) -> None:
        await self._follower.start(self.state.last_seq + 1)

    def names_for_model(self, model_id: str) -> LogNames:
        return SHARED  # one log followed: a node that follows groups reads a ClusterView

    def names_for_task(self, task_id: TaskId) -> LogNames:
        return self.names

    @property
    def gap(self) -> str:
        """Why this view is not a faithful fold of the log ("" when it is)."""
        return self._follower.gap

    async def stop(self) -> None:
        await self._follower.stop()

    async def wait_for(self, seq: int, timeout: float = 10.0) -> State:
        """Return once State includes event `seq` (e.g. one this node just appended)."""
        async with self._advanced:
            await asyncio.wait_for(self._advanced.wait_for(lambda: self.state.last_seq >= seq), timeout)
        return self.state

    async def _on_event(self, seq: int, event: AnyEvent, verify: SignatureCheck) -> None:
        self.state = apply(self.state, event, seq, verify)
        await self._advance(seq, event)

    async def _on_undecodable(self, seq: int, reason: str) -> None:
        self.state = skip_event(self.state, seq, reason)
        await self._advance(seq, None)

    async def _advance(self, seq: int, event: AnyEvent | None) -> None:
        async with self._advanced:
            self._advanced.notify_all()
        if event is None:
            return
        for listener in self._listeners:
            try:
                result = listener(seq, event, self.state)
                if result is not None:
                    await result
            except Exception:  # one listener's failure must not keep the event from the others
                log.exception("a State listener failed on event %d (%s)", seq, type(event).__name__)
