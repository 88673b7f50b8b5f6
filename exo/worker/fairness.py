"""In what order a runner is given its instance's waiting tasks, and how many at once.

A runner decodes at most its batch's worth of rows together (EXO_MAX_BATCH) and takes what it is
given in order, so the queue is kept here, on rank 0's worker, and a task is forwarded when its
rows fit: a request of n choices (or best_of candidates) decodes n rows and takes n slots
(requests.rows_of, as the master counts it). The next task is the interactive tier's before the
batch tier's; within a tier, the key with the fewest rows in the runner goes first (oldest task
first among equals). So one key's flood of requests waits its turn behind another key's single one
instead of ahead of it: that one starts as soon as its rows free. The next task waits for its rows
rather than let smaller ones past it, so a wide one is never starved; one wider than the whole
batch goes alone, once the runner is empty. Requests without a key count as one key ("").
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from exo.core.requests import rows_of
from exo.core.types import Task

_TIER_ORDER = {"interactive": 0, "batch": 1}


def next_to_forward(waiting: list[Task], in_runner: Iterable[Task], batch_rows: int) -> list[Task]:
    """What of `waiting` fits in the rows `in_runner` leaves of `batch_rows`, fairly (see the module's docstring)."""
    rows_by_key: Counter[str] = Counter()
    for task in in_runner:
        rows_by_key[task.key_id] += rows_of(task.params)
    free = batch_rows - sum(rows_by_key.values())
    queues: dict[tuple[int, str], list[Task]] = {}
    for task in sorted(waiting, key=lambda t: (t.created_at, t.task_id)):
        queues.setdefault((_TIER_ORDER.get(task.priority, 0), task.key_id), []).append(task)
    chosen: list[Task] = []
    while queues:
        tier, key_id = min(queues, key=lambda q: (q[0], rows_by_key[q[1]], queues[q][0].created_at, q[1]))
        rows = rows_of(queues[(tier, key_id)][0].params)
        if not _fits(rows, free, batch_rows):  # it waits for its rows, and the tasks behind it with it
            break
        task = queues[(tier, key_id)].pop(0)
        if not queues[(tier, key_id)]:
            del queues[(tier, key_id)]
        rows_by_key[key_id] += rows
        free -= rows
        chosen.append(task)
    return chosen


def _fits(rows: int, free: int, batch_rows: int) -> bool:
    """Whether a task of `rows` goes now: its rows are free, or it is wider than the whole batch and
    the runner is empty (nothing in it, nothing chosen yet)."""
    return rows <= free or (0 < batch_rows == free)
