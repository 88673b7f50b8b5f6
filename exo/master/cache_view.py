"""What the master knows of each instance's prompt cache: the latest report of its rank 0 runner
(exo/core/cache_reports.py), in memory only. A soft hint for routing (exo/master/routing.py), not
State: nothing in the log depends on it, a master that has heard no report yet routes on State
alone, and a report lost on the way is replaced by the next one (they are snapshots)."""

from __future__ import annotations

from collections.abc import Mapping, Set

from exo.core.cache_reports import CacheReport, speaks_for
from exo.core.ids import InstanceId, TaskId
from exo.core.state import State


class CacheView:
    def __init__(self) -> None:
        self._dropped: dict[InstanceId, frozenset[TaskId]] = {}
        self._held: dict[InstanceId, dict[TaskId, int]] = {}
        self.refused = 0  # reports not taken: of an instance State lacks, or not from its rank 0's node and runner

    def accept(self, state: State, report: CacheReport) -> bool:
        """Keep `report` as its instance's latest if it speaks for that instance's rank 0 in `state`."""
        if not speaks_for(state, report):
            self.refused += 1
            return False
        for gone in [i for i in self._dropped if i not in state.instances]:
            self._forget(gone)
        self._dropped[report.instance_id] = frozenset(report.contents.dropped)
        self._held[report.instance_id] = {entry.task_id: entry.tokens for entry in report.contents.held}
        return True

    @property
    def dropped(self) -> Mapping[InstanceId, Set[TaskId]]:
        """By instance, the tasks whose entries its runner no longer holds (instances without a report: absent)."""
        return self._dropped

    def held(self, instance_id: InstanceId) -> Mapping[TaskId, int] | None:
        """The entries an instance's runner holds, by task, with their tokens (None: no report of it)."""
        return self._held.get(instance_id)

    def _forget(self, instance_id: InstanceId) -> None:
        self._dropped.pop(instance_id, None)
        self._held.pop(instance_id, None)
