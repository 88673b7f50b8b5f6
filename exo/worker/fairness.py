"""In what order a runner is given its instance's waiting tasks, and how many at once.

A runner decodes at most its batch's worth together (EXO_MAX_BATCH) and takes what it is given in
order, so the queue is kept here, on rank 0's worker, and a task is forwarded when a slot frees.
The next task is the interactive tier's before the batch tier's; within a tier, the key with the
fewest tasks in the runner goes first (oldest task first among equals). So one key's flood of
requests waits its turn behind another key's single one instead of ahead of it: that one starts
as soon as one slot frees. Requests without a key count as one key ("").
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from exo.core.types import Task

_TIER_ORDER = {"interactive": 0, "batch": 1}


def next_to_forward(waiting: list[Task], in_runner: Iterable[Task], slots: int) -> list[Task]:
    """Up to `slots` of `waiting`, fairly (see the module's docstring)."""
    counts = Counter(t.key_id for t in in_runner)
    queues: dict[tuple[int, str], list[Task]] = {}
    for task in sorted(waiting, key=lambda t: (t.created_at, t.task_id)):
        queues.setdefault((_TIER_ORDER.get(task.priority, 0), task.key_id), []).append(task)
    chosen: list[Task] = []
    while queues and len(chosen) < slots:
        tier, key_id = min(queues, key=lambda q: (q[0], counts[q[1]], queues[q][0].created_at, q[1]))
        task = queues[(tier, key_id)].pop(0)
        if not queues[(tier, key_id)]:
            del queues[(tier, key_id)]
        counts[key_id] += 1
        chosen.append(task)
    return chosen
