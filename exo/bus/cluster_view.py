"""What an API node or a worker reads: the shared log's State with every master group's requests
laid over it (exo/core/groups.py), and where to send a model's commands or a task's events.

It follows the shared log and every group log the shared State names (`group_logs`), or only
those `wants` picks (a worker-only node: the groups of the models it has ranks of); a group named
or wanted later is caught up in the background, and followed from then on.
Listeners hear every log's events, each with the cluster State as of that event.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from msgspec.structs import replace
from nats.aio.client import Client

from exo.bus.catch_up import catch_up
from exo.bus.errors import raise_if_cancelled
from exo.bus.provision import provision_group
from exo.bus.state_view import Listener, StateView
from exo.bus.subjects import SHARED, LogNames, group_names
from exo.core.events import AnyEvent, GroupsSet, InstanceCreated
from exo.core.groups import LiveUnion, for_cluster, group_of
from exo.core.ids import TaskId
from exo.core.state import State

log = logging.getLogger(__name__)

FOLLOW_RETRY_MAX_S = 30.0  # the longest wait between tries to follow a group's log


class ClusterView:
    def __init__(self, nc: Client, shared: StateView, wants: Callable[[State], set[str]] | None = None) -> None:
        self._nc = nc
        self._wants = wants
        self.shared = shared
        self.groups: dict[str, StateView] = {}
        self._listeners: list[Listener] = []
        self._state: State | None = None  # the merged State, made again when a log moves on
        self._made_of: list[State] = []  # the States it was made of (by identity: each fold makes a new one)
        self._following: set[str] = set()
        self._background: set[asyncio.Task[None]] = set()
        self._on_group: list[Callable[[StateView], None]] = []
        self._union = LiveUnion()  # every log's tasks and answered commands, patched per event
        self._union.add_log(shared.state)
        self._folded: dict[str, State] = {"": shared.state}  # each log's State as the union has it
        shared.add_listener(self._on_shared_event)

    @property
    def state(self) -> State:
        logs = [self.shared.state, *(v.state for v in self.groups.values())]
        if self._state is None or len(logs) != len(self._made_of) or any(
                a is not b for a, b in zip(logs, self._made_of, strict=True)):
            self._state = for_cluster(logs[0], logs[1:], union=self._union)
            self._made_of = logs
        return self._state

    @property
    def gap(self) -> str:
        return next((g for g in [self.shared.gap, *(v.gap for v in self.groups.values())] if g), "")

    def add_listener(self, listener: Listener) -> None:
        self._listeners.append(listener)

    async def follow_groups(self) -> None:
        """Catch up every group log the shared State names; before anything on the node acts."""
        for group in self._wanted(self.shared.state):
            await self._follow(group)

    def on_group(self, call: Callable[[StateView], None]) -> None:
        """`call` with each group's view, once caught up: those followed now, and later ones."""
        self._on_group.append(call)
        for view in self.groups.values():
            call(view)

    def names_for_model(self, model_id: str) -> LogNames:
        """Where a request for the model goes: its group's master, or the shared one."""
        group = group_of(model_id, self.shared.state.groups)
        return group_names(group) if group in self.groups else SHARED

    def names_for_task(self, task_id: TaskId) -> LogNames:
        """The log that holds the task (its events go there), the shared one if none does."""
        return next((view.names for view in self.groups.values() if task_id in view.state.tasks), SHARED)

    async def stop(self) -> None:
        for task in list(self._background):
            task.cancel()
        for view in [*self.groups.values(), self.shared]:
            await view.stop()

    async def _follow(self, group: str) -> None:
        if group in self._following:
            return
        self._following.add(group)
        names = group_names(group)
        await provision_group(self._nc, names)
        view, _ = await catch_up(self._nc, names=names)
        # No await from here to the listener: no event can be folded in between.
        self._union.add_log(view.state)
        self._folded[group] = view.state
        view.add_listener(lambda seq, event, state: self._on_group_event(group, event, seq, state))
        self.groups[group] = view
        for call in self._on_group:
            call(view)
        log.info("following master group %s's log (%s), at sequence %d", group, names.events_stream, view.state.last_seq)

    async def _on_shared_event(self, seq: int, event: AnyEvent, state: State) -> None:
        self._union.fold(self._folded[""], state, event)
        self._folded[""] = state
        if isinstance(event, (GroupsSet, InstanceCreated)):
            for group in self._wanted(state):
                if group not in self._following:
                    task = asyncio.create_task(self._follow_logged(group))
                    self._background.add(task)
                    task.add_done_callback(self._background.discard)
        if self._listeners:  # a master-only node has none: no cluster State to make per event
            await self._tell(seq, event, self.state)

    async def _on_group_event(self, group: str, event: AnyEvent, seq: int, group_state: State) -> None:
        self._union.fold(self._folded[group], group_state, event)
        self._folded[group] = group_state
        if not self._listeners:
            return
        # The cluster State, with the position and skipped events of the log this event is in.
        merged = replace(self.state, last_seq=group_state.last_seq, skipped_events=group_state.skipped_events)
        await self._tell(seq, event, merged)

    def _wanted(self, state: State) -> list[str]:
        wanted = None if self._wants is None else self._wants(state)
        return [g for g in state.group_logs if wanted is None or g in wanted]

    async def _follow_logged(self, group: str) -> None:
        """Tried again until it works: the map that named the group may be the last one the log
        gets, and a node that does not follow a group never campaigns to lead it."""
        delay = 1.0
        while True:
            try:
                await self._follow(group)
                return
            except Exception:
                raise_if_cancelled()
                self._following.discard(group)
                log.exception("could not follow master group %s's log; trying again in %.0f s", group, delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, FOLLOW_RETRY_MAX_S)

    async def _tell(self, seq: int, event: AnyEvent, state: State) -> None:
        for listener in self._listeners:
            try:
                result = listener(seq, event, state)
                if result is not None:
                    await result
            except Exception:  # one listener's failure must not keep the event from the others
                log.exception("a cluster State listener failed on event %d (%s)", seq, type(event).__name__)

