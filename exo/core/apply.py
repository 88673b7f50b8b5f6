"""The pure reducer: State x event -> State. The same function runs on every node and in replay.

It never raises on an event it cannot use: it records the event as skipped and moves on, so
one bad event cannot wedge a node. Ordering and gap checks belong to the log reader.
"""

from __future__ import annotations

from typing import TypeVar, assert_never

from msgspec.structs import replace

from exo.core.events import (
    AnyEvent,
    CommandRejected,
    CustomCardAdded,
    CustomCardDeleted,
    DownloadDeleted,
    DownloadFailed,
    DownloadProgressed,
    InstanceCreated,
    InstanceDeleted,
    LeaderElected,
    NodeRegistered,
    RunnerStatusChanged,
    TaskCancelRequested,
    TaskCreated,
    TaskFinished,
    TaskStarted,
    command_id_of,
)
from exo.core.state import MAX_ANSWERED_COMMANDS, MAX_FINISHED_TASKS, MAX_SKIPPED_KEPT, SkippedEvent, State
from exo.core.types import DownloadProgress, RunnerInfo, Task


V = TypeVar("V")


class _Skip(Exception):
    """An event that is well-formed but does not fit the State (e.g. names an unknown task)."""


def apply(state: State, event: AnyEvent, seq: int) -> State:
    try:
        if event.term and event.term < state.leader_term:
            raise _Skip(f"from term {event.term}, older than the leader's term {state.leader_term}")
        new_state = _apply(state, event, seq)
    except _Skip as skip:
        return skip_event(state, seq, str(skip))
    if command_id := command_id_of(event):
        return replace(new_state, last_seq=seq, answered_commands=_remember(state.answered_commands, command_id, seq))
    return replace(new_state, last_seq=seq)


def _with(mapping: dict[str, V], key: str, value: V) -> dict[str, V]:
    """A copy with one entry set (dict.copy is the fast path for large maps)."""
    updated = mapping.copy()
    updated[key] = value
    return updated


def _remember(answered: dict[str, int], command_id: str, seq: int) -> dict[str, int]:
    updated = _with(answered, command_id, seq)
    if len(updated) > MAX_ANSWERED_COMMANDS:
        del updated[next(iter(updated))]
    return updated


def skip_event(state: State, seq: int, reason: str) -> State:
    """Advance past an event that cannot be used, keeping a bounded record of why."""
    skipped = [*state.skipped_events, SkippedEvent(seq=seq, reason=reason)][-MAX_SKIPPED_KEPT:]
    return replace(state, last_seq=seq, skipped_events=skipped)


def _apply(state: State, event: AnyEvent, seq: int) -> State:
    match event:
        case LeaderElected():
            return _on_leader_elected(state, event)
        case NodeRegistered():
            return _on_node_registered(state, event)
        case InstanceCreated():
            return _on_instance_created(state, event, seq)
        case InstanceDeleted():
            return _on_instance_deleted(state, event)
        case RunnerStatusChanged():
            return _on_runner_status(state, event)
        case TaskCreated():
            return _on_task_created(state, event)
        case TaskCancelRequested():
            return _on_task_update(state, event.task_id, cancel_requested=True)
        case TaskStarted():
            return _on_task_update(state, event.task_id, status="running")
        case TaskFinished():
            return _on_task_finished(state, event)
        case CustomCardAdded():
            return replace(state, custom_model_cards=_with(state.custom_model_cards, event.card.model_id, event.card))
        case CustomCardDeleted():
            return _on_card_deleted(state, event)
        case CommandRejected():
            return state  # an answer to a caller; State does not change
        case DownloadProgressed():
            return _set_download(state, event.progress)
        case DownloadFailed():
            return _on_download_failed(state, event)
        case DownloadDeleted():
            return _on_download_deleted(state, event)
        case _:
            assert_never(event)


def _on_leader_elected(state: State, event: LeaderElected) -> State:
    if event.term <= state.leader_term:
        raise _Skip(f"leader term {event.term} is not newer than {state.leader_term}")
    return replace(state, leader_term=event.term, leader_node=event.node_id)


def _on_node_registered(state: State, event: NodeRegistered) -> State:
    return replace(state, nodes=_with(state.nodes, event.node.node_id, event.node))


def _on_instance_created(state: State, event: InstanceCreated, seq: int) -> State:
    instance = replace(event.instance, created_seq=seq)
    if instance.instance_id in state.instances:
        raise _Skip(f"instance {instance.instance_id} already exists")
    runners = dict(state.runners)
    for shard in instance.shards:
        runners[shard.runner_id] = RunnerInfo(
            runner_id=shard.runner_id, instance_id=instance.instance_id, node_id=shard.node_id
        )
    return replace(state, instances=_with(state.instances, instance.instance_id, instance), runners=runners)


def _on_instance_deleted(state: State, event: InstanceDeleted) -> State:
    if event.instance_id not in state.instances:
        raise _Skip(f"unknown instance {event.instance_id}")
    instances = {k: v for k, v in state.instances.items() if k != event.instance_id}
    runners = {k: v for k, v in state.runners.items() if v.instance_id != event.instance_id}
    return replace(state, instances=instances, runners=runners)


def _on_runner_status(state: State, event: RunnerStatusChanged) -> State:
    runner = state.runners.get(event.runner_id)
    if runner is None:
        raise _Skip(f"unknown runner {event.runner_id}")
    updated = replace(runner, status=event.status, error=event.error)
    return replace(state, runners=_with(state.runners, event.runner_id, updated))


def _on_task_created(state: State, event: TaskCreated) -> State:
    if event.task.task_id in state.tasks:
        raise _Skip(f"task {event.task.task_id} already exists")
    return replace(state, tasks=_with(state.tasks, event.task.task_id, event.task))


def _open_task(state: State, task_id: str) -> Task:
    task = state.tasks.get(task_id)
    if task is None:
        raise _Skip(f"unknown task {task_id}")
    if task.status not in ("pending", "running"):
        raise _Skip(f"task {task_id} already {task.status}")
    return task


def _on_task_update(state: State, task_id: str, **changes: object) -> State:
    task = _open_task(state, task_id)
    return replace(state, tasks=_with(state.tasks, task_id, replace(task, **changes)))


def _on_task_finished(state: State, event: TaskFinished) -> State:
    """Finish the task, and keep State bounded: only the most recent MAX_FINISHED_TASKS
    finished tasks stay (one copy of the task map: this runs for every request)."""
    task = _open_task(state, event.task_id)
    tasks = _with(state.tasks, event.task_id, replace(
        task, status=event.status, finish_reason=event.finish_reason, error=event.error,
        prompt_tokens=event.prompt_tokens, completion_tokens=event.completion_tokens,
    ))
    order = state.finished_task_ids + [event.task_id]
    if len(order) > MAX_FINISHED_TASKS:
        tasks.pop(order[0], None)
        order = order[1:]
    return replace(state, tasks=tasks, finished_task_ids=order)


def _on_card_deleted(state: State, event: CustomCardDeleted) -> State:
    if event.model_id not in state.custom_model_cards:
        raise _Skip(f"unknown custom card {event.model_id}")
    cards = {k: v for k, v in state.custom_model_cards.items() if k != event.model_id}
    return replace(state, custom_model_cards=cards)


def _set_download(state: State, progress: DownloadProgress) -> State:
    of_node = _with(state.downloads.get(progress.node_id, {}), progress.model_id, progress)
    return replace(state, downloads=_with(state.downloads, progress.node_id, of_node))


def _on_download_failed(state: State, event: DownloadFailed) -> State:
    # Keep what the last progress said (bytes done, files): a retry resumes from there.
    previous = state.download_of(event.node_id, event.model_id) or DownloadProgress(
        node_id=event.node_id, model_id=event.model_id
    )
    return _set_download(state, replace(
        previous, status="failed", error_code=event.code, error=event.reason, speed_bps=0.0, eta_s=None,
        updated_at=event.at,
    ))


def _on_download_deleted(state: State, event: DownloadDeleted) -> State:
    of_node = state.downloads.get(event.node_id, {})
    if event.model_id not in of_node:
        raise _Skip(f"no download of {event.model_id} on node {event.node_id}")
    remaining = {k: v for k, v in of_node.items() if k != event.model_id}
    if remaining:
        return replace(state, downloads=_with(state.downloads, event.node_id, remaining))
    return replace(state, downloads={k: v for k, v in state.downloads.items() if k != event.node_id})
