"""Master groups (issue #34): the requests of a set of models decided by a master of their own.

A group owns the per-request part of the cluster for its models: their tasks, the commands that
make and cancel them, and the log those land in (its own stream, lease, term and snapshots). The
shared log keeps everything else: nodes, cards, adapters, keys, desires, instances and runners
(placement counts every node's memory, so one master places), and the group map itself.

A group's State is folded from its own log alone (replay and a late joiner get the same State
whatever the shared log did meanwhile); the views that decide and serve lay it over the shared
State (`for_group`, `for_cluster`). Pure: no I/O.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from fnmatch import fnmatchcase
from typing import TypeVar

from msgspec.structs import replace

from exo.core.draft import Draft
from exo.core.events import (
    AnyEvent,
    CommandRejected,
    GroupsSet,
    KeySet,
    LeaderElected,
    TaskCancelRequested,
    TaskCreated,
    TaskFinished,
    TaskMigrated,
    TaskStarted,
    command_id_of,
)
from exo.core.ids import CommandId, TaskId
from exo.core.skip import Skip
from exo.core.state import State
from exo.core.types import Task
from exo.core.usage import UsageByDay, UsageCounts

K = TypeVar("K")
V = TypeVar("V")

GroupMap = dict[str, list[str]]  # group name -> model-id globs, first matching group wins

GROUP_NAME = re.compile(r"[a-z][a-z0-9_-]{0,31}")  # a subject token and a stream-name suffix
MAX_GROUPS = 64
MAX_GLOBS = 64
MAX_GLOB_CHARS = 200

# What a group's log may hold: its elections, its requests' lifecycle, and copies of the keys it
# admitted requests of (counted in its own windows). Anything else there is skipped.
GROUP_KINDS: frozenset[type] = frozenset({
    LeaderElected, TaskCreated, TaskCancelRequested, TaskStarted, TaskFinished, TaskMigrated, CommandRejected, KeySet,
})


def parse_groups(text: str) -> GroupMap:
    """`chat=org/*|meta/*,code=*coder*` (EXO_MASTER_GROUPS); "" is no groups: one master, as before."""
    groups: GroupMap = {}
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        name, sep, globs = part.partition("=")
        if not sep:
            raise ValueError(f"master group {part!r}: expected name=glob[|glob...]")
        name = name.strip()
        if name in groups:
            raise ValueError(f"master group {name!r} is named twice")
        groups[name] = [g.strip() for g in globs.split("|") if g.strip()]
    if problem := groups_problem(groups):
        raise ValueError(problem)
    return groups


def groups_problem(groups: Mapping[str, Sequence[str]]) -> str:
    """Why a group map cannot be used ("" if it can): the reducer checks every one it folds."""
    if len(groups) > MAX_GROUPS:
        return f"{len(groups)} master groups, more than {MAX_GROUPS}"
    for name, globs in groups.items():
        if not GROUP_NAME.fullmatch(name):
            return f"master group {name!r}: a name is a lowercase letter, then up to 31 of a-z, 0-9, _ and -"
        if not globs or len(globs) > MAX_GLOBS:
            return f"master group {name!r}: 1 to {MAX_GLOBS} model globs, not {len(globs)}"
        if any(not glob or len(glob) > MAX_GLOB_CHARS or not glob.isprintable() for glob in globs):
            return f"master group {name!r}: a glob is 1 to {MAX_GLOB_CHARS} printable characters"
    return ""


def group_of(model_id: str, groups: Mapping[str, Sequence[str]]) -> str:
    """The group deciding the model's requests: the first whose glob matches; "" the shared master."""
    return next((name for name, globs in groups.items() if any(fnmatchcase(model_id, g) for g in globs)), "")


def groups_ranked_on(state: State, node_id: str) -> set[str]:
    """The groups whose requests a worker-only node can be given: those of the models it has ranks of."""
    return {group for i in state.instances.values() if any(s.node_id == node_id for s in i.shards)
            if (group := group_of(i.model_id, state.groups))}


def on_groups_set(draft: Draft, event: GroupsSet, seq: int) -> None:
    if problem := groups_problem(event.groups):
        raise Skip(problem)
    draft.groups = {name: list(globs) for name, globs in event.groups.items()}
    if new := [name for name in event.groups if name not in draft.group_logs]:
        draft.group_logs = [*draft.group_logs, *new]


def for_group(shared: State, group: State) -> State:
    """What a group's master decides on: the cluster (instances, runners, nodes, keys, desires) from
    the shared log; the requests, their key windows and usage, and the log's own position and
    leader from the group's."""
    return replace(
        shared, last_seq=group.last_seq, leader_term=group.leader_term, leader_node=group.leader_node,
        leader_by_sequence=group.leader_by_sequence, skipped_events=group.skipped_events, tasks=group.tasks,
        finished_task_ids=group.finished_task_ids, answered_commands=group.answered_commands,
        key_windows=group.key_windows, usage=group.usage, usage_totals=group.usage_totals,
        migrations_total=group.migrations_total, group=group.group,
    )


def for_cluster(shared: State, groups: Sequence[State], source: State | None = None,
                union: LiveUnion | None = None) -> State:
    """What an API node or worker reads: the shared State with every group's requests added.
    The log position and skipped events are `source`'s (the log whose event was just folded), so
    a listener's `was_skipped(state, seq)` asks the right log. `union`: the tasks and answered
    commands of every log, kept up to date by the caller (else made here)."""
    if not groups:
        return shared
    logs = [shared, *groups]
    source = source or shared
    return replace(
        shared, last_seq=source.last_seq, skipped_events=source.skipped_events,
        tasks=union.tasks if union is not None else _union([s.tasks for s in logs]),
        answered_commands=union.answered if union is not None else _union([s.answered_commands for s in logs]),
        key_windows=_union([s.key_windows for s in logs]), usage=_usage_sum([s.usage for s in logs]),
        usage_totals=_totals_sum([s.usage_totals for s in logs]),
        migrations_total=sum(s.migrations_total for s in logs),
    )


class LiveUnion:
    """Every followed log's tasks and answered commands, one dict each, patched event by event: a
    union made afresh per event cost an API node ~0.2 ms an event at two groups (bench/groups.py).
    The dicts are live: a State made with them sees later events too (read them, do not keep them
    across an await). Each task and command is in one log only (one master decided it)."""

    def __init__(self) -> None:
        self.tasks: dict[TaskId, Task] = {}
        self.answered: dict[CommandId, int] = {}

    def add_log(self, state: State) -> None:
        self.tasks.update(state.tasks)
        self.answered.update(state.answered_commands)

    def fold(self, before: State, after: State, event: AnyEvent) -> None:
        """`after` is `before` with `event` folded in (one event: what a StateView's listener hears)."""
        if after.tasks is not before.tasks:
            touched = {event.task.task_id} if isinstance(event, TaskCreated) else {getattr(event, "task_id", "")}
            if before.finished_task_ids and before.finished_task_ids[0] not in after.tasks:
                touched.add(before.finished_task_ids[0])  # evicted: State keeps 1,000 finished tasks
            for task_id in touched:
                _patch(self.tasks, TaskId(task_id), after.tasks)
        if after.answered_commands is not before.answered_commands:
            touched = {command_id_of(event), next(iter(before.answered_commands), "")}  # answered, evicted
            for command_id in touched:
                _patch(self.answered, CommandId(command_id), after.answered_commands)


def _patch(into: dict[K, V], key: K, source: dict[K, V]) -> None:
    if key in source:
        into[key] = source[key]
    else:
        into.pop(key, None)


def _union(dicts: list[dict[K, V]]) -> dict[K, V]:
    non_empty = [d for d in dicts if d]
    if len(non_empty) <= 1:  # the usual case (every model in a group, or one group): no copy
        return non_empty[0] if non_empty else dicts[0]
    merged: dict[K, V] = {}
    for d in non_empty:
        merged.update(d)
    return merged


def _usage_sum(usages: list[UsageByDay]) -> UsageByDay:
    non_empty = [u for u in usages if u]
    if len(non_empty) <= 1:
        return non_empty[0] if non_empty else usages[0]
    total: UsageByDay = {}
    for usage in non_empty:
        for key_id, days in usage.items():
            for day, models in days.items():
                into = total.setdefault(key_id, {}).setdefault(day, {})
                for model_id, counts in models.items():
                    into[model_id] = into.get(model_id, UsageCounts()).plus(counts)
    return total


def _totals_sum(totals: list[dict[str, dict[str, UsageCounts]]]) -> dict[str, dict[str, UsageCounts]]:
    non_empty = [t for t in totals if t]
    if len(non_empty) <= 1:
        return non_empty[0] if non_empty else totals[0]
    total: dict[str, dict[str, UsageCounts]] = {}
    for by_key in non_empty:
        for key_id, models in by_key.items():
            into = total.setdefault(key_id, {})
            for model_id, counts in models.items():
                into[model_id] = into.get(model_id, UsageCounts()).plus(counts)
    return total
