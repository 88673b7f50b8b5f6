"""The worker's part of cache-aware routing: what the rank 0 runners of this node say their prompt
caches hold goes to the masters (exo/bus/cache_reports.py) as soon as it changes, and again every
REPUBLISH_S, so a master that starts or takes over learns it without waiting for a change."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from exo.bus.cache_reports import publish_cache_report
from exo.bus.connection import Connection
from exo.bus.throttled_log import ThrottledLog
from exo.core.cache_reports import CacheContents, CacheReport, rank_zero
from exo.core.ids import InstanceId, NodeId, RunnerId
from exo.core.state import State

log = logging.getLogger(__name__)

REPUBLISH_S = 10.0


def report_of(state: State, node_id: NodeId, runner_id: RunnerId, contents: CacheContents) -> CacheReport | None:
    """The report for the instance whose rank 0 is `runner_id` on this node (None: no such instance),
    naming only tasks State still has: the master knows no others, and the report stays small."""
    instance = next((i for i in state.instances.values() if any(s.runner_id == runner_id for s in i.shards)), None)
    shard = rank_zero(instance) if instance is not None else None
    if instance is None or shard is None or (shard.runner_id, shard.node_id) != (runner_id, node_id):
        return None
    kept = CacheContents(held=[entry for entry in contents.held if entry.task_id in state.tasks],
                         dropped=[task_id for task_id in contents.dropped if task_id in state.tasks])
    return CacheReport(instance_id=instance.instance_id, node_id=node_id, runner_id=runner_id, contents=kept)


class CacheReporter:
    def __init__(self, nc: Connection, node_id: NodeId, state: Callable[[], State]) -> None:
        self._nc = nc
        self._node_id = node_id
        self._state = state
        self._latest: dict[InstanceId, CacheReport] = {}
        self._changed: set[InstanceId] = set()
        self._wake = asyncio.Event()
        self._failures = ThrottledLog(log)

    def on_cache_held(self, runner_id: RunnerId, contents: CacheContents) -> None:
        """A runner's report (its process's stdout): kept, and published soon if it is a rank 0's."""
        report = report_of(self._state(), self._node_id, runner_id, contents)
        if report is not None:
            self._latest[report.instance_id] = report
            self._changed.add(report.instance_id)
            self._wake.set()

    async def run(self) -> None:
        """Publish each report that changed at once, and all of them every REPUBLISH_S."""
        loop = asyncio.get_running_loop()
        next_round = loop.time() + REPUBLISH_S
        while True:
            with contextlib.suppress(TimeoutError):  # the round is due: every report goes out again
                await asyncio.wait_for(self._wake.wait(), max(0.0, next_round - loop.time()))
            self._wake.clear()
            due, self._changed = self._changed, set()
            if loop.time() >= next_round:
                due, next_round = set(self._latest), loop.time() + REPUBLISH_S
            state = self._state()
            for instance_id in list(self._latest):
                if instance_id not in state.instances:
                    del self._latest[instance_id]  # deleted: nothing to route to
            for report in [self._latest[i] for i in due if i in self._latest]:
                try:
                    await publish_cache_report(self._nc, report)
                    self._failures.forget("publish")
                except Exception as error:  # the bus away: the next change, or the next round, sends it
                    self._failures.warning("publish", "worker: cache report not published: %r", error)
