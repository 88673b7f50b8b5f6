"""What a master group's master decides beyond `decide` (exo/core/groups.py has the split): only
its models' requests; copies of the keys it counts; and its requests whose instance the shared
master ended (the shared master cannot move them: they are in the group's log, not its own).

Pure: State (the group's laid over the shared one), the time and the limits come in.
"""

from __future__ import annotations

from collections.abc import Mapping

from exo.core.commands import AnyCommand, CancelTask, GenerateText, command_tag
from exo.core.events import CommandRejected, Event, GroupsSet, KeySet, TaskCancelRequested, TaskFinished, TaskMigrated
from exo.core.ids import InstanceId, NodeId
from exo.core.keys import ApiKey
from exo.core.state import State
from exo.master.decide import deleted_keys_tasks_ended
from exo.master.heal import HealLimits, usable_instance, waiting_tasks

# A request newer than this is left alone even if its instance is not in the shared State: a master
# that just took over may follow the shared log a little behind the group's (the instance is new).
SETTLE_S = 2.0


def not_for_group(state: State, command: AnyCommand) -> list[Event]:
    """A rejection for a command a group's master does not decide ([] for one it does). A request
    for a model the map has since moved elsewhere is still decided: its API node routed it by the
    map it had, and every node follows every group's log."""
    if isinstance(command, (CancelTask, GenerateText)):
        return []
    return [CommandRejected(command_id=command.command_id, command_kind=command_tag(command), code="invalid",
                            reason=f"master group {state.group!r} decides requests only; {command_tag(command)} "
                                   "goes to the shared master")]


def key_copy(shared_keys: Mapping[str, ApiKey], copied: dict[str, ApiKey], command: AnyCommand) -> list[Event]:
    """The request's key, copied into the group's log where its copy is missing or outdated: the
    group's log counts the key's windows and usage (its fold must not read the shared log)."""
    if not isinstance(command, GenerateText) or not command.key_id:
        return []
    key = shared_keys.get(command.key_id)
    if key is None or copied.get(key.key_id) == key:
        return []
    copied[key.key_id] = key
    return [KeySet(key=key)]


def groups_to_set(wanted: Mapping[str, list[str]], state: State) -> list[Event]:
    """The shared master's: the group map from its settings, when the log names another."""
    return [] if dict(wanted) == state.groups else [GroupsSet(groups=dict(wanted))]


def heal_group(state: State, now: float, limits: HealLimits, lost: frozenset[NodeId] = frozenset()) -> list[Event]:
    """The group's requests whose instance is gone from the shared State move to another instance
    of their model, or wait for one (its desire re-places it), or end; waiting ones are placed. The
    requests of a key the shared master deleted end as its own would (it cannot see the group's)."""
    events = deleted_keys_tasks_ended(t for t in state.tasks.values() if t.key_id and t.key_id not in state.api_keys
                                      and now - t.created_at >= SETTLE_S)
    ending = {e.task_id for e in events if isinstance(e, (TaskCancelRequested, TaskFinished))}
    for task in state.tasks.values():
        if task.task_id in ending:
            continue
        if task.status not in ("pending", "running") or not task.instance_id or task.instance_id in state.instances:
            continue
        if now - task.created_at < SETTLE_S:
            continue
        reason = state.instance_end_reasons.get(task.model_id, "its instance was deleted")
        if task.cancel_requested:
            events.append(TaskFinished(task_id=task.task_id, status="cancelled", finish_reason="cancelled",
                                       error=f"instance deleted: {reason}"))
        elif len(task.migrations) >= limits.max_migrations:
            events.append(TaskFinished(task_id=task.task_id, status="failed", finish_reason="error",
                                       error=f"instance deleted: {reason}; the generation was moved "
                                             f"{len(task.migrations)} time(s) already, the most allowed"))
        elif (target := usable_instance(state, task.model_id, lost=lost)) is not None or any(
                d.model_id == task.model_id for d in state.desires.values()):
            to = target.instance_id if target is not None else InstanceId("")
            events.append(TaskMigrated(task_id=task.task_id, to_instance=to,
                                       reason=f"instance {task.instance_id}: {reason}", at=now))
        else:
            events.append(TaskFinished(task_id=task.task_id, status="failed", finish_reason="error",
                                       error=f"instance deleted: {reason}"))
    return events or waiting_tasks(state, now, limits, lost)
