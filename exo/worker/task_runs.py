"""Which run of each task this node forwarded and ended. A task moved to another instance (a
migration: exo/master/heal.py) starts a new run; an earlier run's end here must not stop a later
run from being forwarded here, and a runner's reports speak for the run it was given."""

from __future__ import annotations

from exo.core.ids import RunnerId, TaskId
from exo.core.state import State
from exo.worker.plan import settled


def run_of(state: State, task_id: TaskId) -> int:
    task = state.tasks.get(task_id)
    return len(task.migrations) if task is not None else 0


class TaskRuns:
    def __init__(self) -> None:
        self._ended: dict[TaskId, int] = {}  # task -> the latest run whose end this node reported
        self._forwarded: dict[tuple[RunnerId, TaskId], int] = {}  # (runner, task given to it) -> its run

    def forwarded(self, runner_id: RunnerId, task_id: TaskId, run: int) -> None:
        self._forwarded[runner_id, task_id] = run

    def run_given(self, runner_id: RunnerId, task_id: TaskId) -> int:
        return self._forwarded.get((runner_id, task_id), 0)

    def finished(self, runner_id: RunnerId, task_id: TaskId) -> int:
        """The runner finished the task: the run it had (which its report names)."""
        run = self._forwarded.pop((runner_id, task_id), 0)
        self._ended[task_id] = max(run, self._ended.get(task_id, 0))
        return run

    def ended(self, state: State, task_id: TaskId) -> None:
        """This node ended the task's current run itself (its runner cannot)."""
        self._ended[task_id] = run_of(state, task_id)

    def ended_ids(self) -> set[TaskId]:
        return set(self._ended)

    def current_ends(self, state: State) -> frozenset[TaskId]:
        """Tasks whose current run this node ended (what the plan must not forward again)."""
        return frozenset(t for t, run in self._ended.items() if (task := state.tasks.get(t)) is None
                         or run >= len(task.migrations))

    def forget_settled(self, state: State) -> set[TaskId]:
        """Drop the ends State has too (it no longer needs this node's memory of them); returns them."""
        done = settled(state, set(self._ended))
        self._ended = {t: run for t, run in self._ended.items() if t not in done}
        return done
