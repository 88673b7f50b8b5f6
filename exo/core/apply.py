"""The pure reducer: State x event -> State. The same function runs on every node and in replay.

It never raises on an event it cannot use: it records the event as skipped and moves on, so
one bad event cannot wedge a node. Ordering and gap checks belong to the log reader.
"""

from __future__ import annotations

from typing import assert_never

from msgspec.structs import replace

from exo.core.events import (
    AnyEvent,
    CommandRejected,
    CustomCardAdded,
    CustomCardDeleted,
    InstanceCreated,
    InstanceDeleted,
    NodeRegistered,
    RunnerStatusChanged,
    TaskCancelRequested,
    TaskCreated,
    TaskFinished,
    TaskStarted,
)
from exo.core.state import MAX_FINISHED_TASKS, MAX_SKIPPED_KEPT, SkippedEvent, State
from exo.core.types import RunnerInfo


class _Skip(Exception):
    """An event that is well-formed but does not fit the State (e.g. names an unknown task)."""


def apply(state: State, event: AnyEvent, seq: int) -> State:
    try:
        new_state = _apply(state, event, seq)
    except _Skip as skip:
        return skip_event(state, seq, str(skip))
    return replace(new_state, last_seq=seq)


def skip_event(state: State, seq: int, reason: str) -> State:
    """Advance past an event that cannot be used, keeping a bounded record of why."""
    skipped = [*state.skipped_events, SkippedEvent(seq=seq, reason=reason)][-MAX_SKIPPED_KEPT:]
    return replace(state, last_seq=seq, skipped_events=skipped)


def _apply(state: State, event: AnyEvent, seq: int) -> State:
    match event:
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
            return replace(state, custom_model_cards={**state.custom_model_cards, event.card.model_id: event.card})
        case CustomCardDeleted():
            return _on_card_deleted(state, event)
        case CommandRejected():
            return state  # an answer to a caller; State does not change
        case _:
            assert_never(event)


def _on_node_registered(state: State, event: NodeRegistered) -> State:
    return replace(state, nodes={**state.nodes, event.node.node_id: event.node})


def _on_instance_created(state: State, event: InstanceCreated, seq: int) -> State:
    instance = replace(event.instance, created_seq=seq)
    if instance.instance_id in state.instances:
        raise _Skip(f"instance {instance.instance_id} already exists")
    runners = dict(state.runners)
    for shard in instance.shards:
        runners[shard.runner_id] = RunnerInfo(
            runner_id=shard.runner_id, instance_id=instance.instance_id, node_id=shard.node_id
        )
    return replace(state, instances={**state.instances, instance.instance_id: instance}, runners=runners)


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
    return replace(state, runners={**state.runners, event.runner_id: updated})


def _on_task_created(state: State, event: TaskCreated) -> State:
    if event.task.task_id in state.tasks:
        raise _Skip(f"task {event.task.task_id} already exists")
    return replace(state, tasks={**state.tasks, event.task.task_id: event.task})


def _on_task_update(state: State, task_id: str, **changes: object) -> State:
    task = state.tasks.get(task_id)
    if task is None:
        raise _Skip(f"unknown task {task_id}")
    if task.status not in ("pending", "running"):
        raise _Skip(f"task {task_id} already {task.status}")
    return replace(state, tasks={**state.tasks, task_id: replace(task, **changes)})


def _on_task_finished(state: State, event: TaskFinished) -> State:
    finished = _on_task_update(
        state,
        event.task_id,
        status=event.status,
        finish_reason=event.finish_reason,
        error=event.error,
        prompt_tokens=event.prompt_tokens,
        completion_tokens=event.completion_tokens,
    )
    return _forget_oldest_finished(finished)


def _forget_oldest_finished(state: State) -> State:
    """Keep State bounded: only the most recent MAX_FINISHED_TASKS finished tasks stay."""
    done = [k for k, t in state.tasks.items() if t.status not in ("pending", "running")]
    if len(done) <= MAX_FINISHED_TASKS:
        return state
    drop = set(done[: len(done) - MAX_FINISHED_TASKS])
    return replace(state, tasks={k: t for k, t in state.tasks.items() if k not in drop})


def _on_card_deleted(state: State, event: CustomCardDeleted) -> State:
    if event.model_id not in state.custom_model_cards:
        raise _Skip(f"unknown custom card {event.model_id}")
    cards = {k: v for k, v in state.custom_model_cards.items() if k != event.model_id}
    return replace(state, custom_model_cards=cards)
