"""The reducer's handlers for a request's life: a task is created, started, moved between
instances, asked to cancel and finished. exo/core/apply.py dispatches to them; the same rules
hold (decide, then change)."""

from __future__ import annotations

from msgspec.structs import replace

from exo.core.apply_access import count_request, count_tokens
from exo.core.conversation import digest_conversation, without_text
from exo.core.draft import Draft
from exo.core.events import TaskCancelRequested, TaskCreated, TaskFinished, TaskMigrated, TaskStarted
from exo.core.ids import InstanceId, NodeId, TaskId
from exo.core.skip import Skip
from exo.core.state import MAX_FINISHED_TASKS
from exo.core.types import Migration, Task


def on_task_created(draft: Draft, event: TaskCreated, seq: int) -> None:
    if event.task.task_id in draft.tasks:
        raise Skip(f"task {event.task.task_id} already exists")
    task = event.task
    draft.own("tasks")[task.task_id] = replace(task, conversation=digest_conversation(task.params),
                                               run_nodes=[_nodes_of(draft, task.instance_id)])
    count_request(draft, task)
    _stamp_use(draft, task, task.created_at)


def _nodes_of(draft: Draft, instance_id: InstanceId) -> list[NodeId]:
    """The nodes of an instance's ranks: who may sign the chunks of a run on it ([]: not in this log)."""
    instance = draft.instances.get(instance_id)
    return [shard.node_id for shard in instance.shards] if instance is not None else []


def _stamp_use(draft: Draft, task: Task, at: float) -> None:
    """The desire serving the task (its instance's, or its model's while it waits) was used at `at`:
    idleness, and so a keep_alive, counts from its latest task's creation or end."""
    instance = draft.instances.get(task.instance_id)
    desire_id = instance.desire_id if instance is not None else next(
        (d.desire_id for d in draft.desires.values() if d.model_id == task.model_id), "")
    stamp_desire_use(draft, desire_id, at)


def stamp_desire_use(draft: Draft, desire_id: str, at: float) -> None:
    """Idleness counts from `at` at the earliest (a task's creation or end, an instance's readiness)."""
    desire = draft.desires.get(desire_id)
    if desire is not None and at > desire.last_used_at:
        draft.own("desires")[desire_id] = replace(desire, last_used_at=at)


def _open_task(draft: Draft, task_id: TaskId) -> Task:
    task = draft.tasks.get(task_id)
    if task is None:
        raise Skip(f"unknown task {task_id}")
    if task.status not in ("pending", "running"):
        raise Skip(f"task {task_id} already {task.status}")
    return task


def on_task_cancel_requested(draft: Draft, event: TaskCancelRequested, seq: int) -> None:
    task = _open_task(draft, event.task_id)
    draft.own("tasks")[event.task_id] = replace(task, cancel_requested=True,
                                                cancel_reason=event.reason or task.cancel_reason)


def on_task_started(draft: Draft, event: TaskStarted, seq: int) -> None:
    task = _open_task(draft, event.task_id)
    _check_attempt(task, event.attempt, "start")
    draft.own("tasks")[event.task_id] = replace(task, status="running")


def _check_attempt(task: Task, attempt: int, what: str) -> None:
    """A worker speaks for the task's current run only: a run it migrated away from (a node that
    paused, then woke) cannot start or end it."""
    if attempt != len(task.migrations):
        raise Skip(f"task {task.task_id}: the {what} of run {attempt}, but it is on run {len(task.migrations)}")


def on_task_migrated(draft: Draft, event: TaskMigrated, seq: int) -> None:
    task = _open_task(draft, event.task_id)
    if event.to_instance and not draft.group:  # a group's log holds no instances: its master checked the shared log
        if event.to_instance not in draft.instances:
            raise Skip(f"task {event.task_id}: unknown instance {event.to_instance}")
        if draft.instances[event.to_instance].model_id != task.model_id:
            raise Skip(f"task {event.task_id}: instance {event.to_instance} serves another model")
    moved = Migration(from_instance=task.instance_id, to_instance=event.to_instance, reason=event.reason, at=event.at)
    waiting_already = not task.instance_id and task.migrations  # from waiting to an instance: the same move
    migrations = [*task.migrations[:-1], replace(task.migrations[-1], to_instance=event.to_instance)] \
        if waiting_already else [*task.migrations, moved]
    run = len(migrations)  # the run that starts on to_instance ("": it waits, no nodes yet)
    run_nodes = [*task.run_nodes[:run], *([[]] * (run - len(task.run_nodes))), _nodes_of(draft, event.to_instance)]
    draft.own("tasks")[event.task_id] = replace(task, instance_id=event.to_instance, status="pending",
                                                migrations=migrations, run_nodes=run_nodes)
    if not waiting_already:
        draft.migrations_total += 1


def on_task_finished(draft: Draft, event: TaskFinished, seq: int) -> None:
    """Finish the task, and keep State bounded: only the most recent MAX_FINISHED_TASKS
    finished tasks stay."""
    task = _open_task(draft, event.task_id)
    if not event.term:  # a worker's: the master ends a task whatever run it is on
        _check_attempt(task, event.attempt, "end")
    tasks = draft.own("tasks")
    tasks[event.task_id] = replace(
        task, params=without_text(task.params),  # the text stays in the log; State keeps its digest
        status=event.status, finish_reason=event.finish_reason, error=event.error,
        prompt_tokens=event.prompt_tokens, completion_tokens=event.completion_tokens,
        cached_tokens=event.cached_tokens,
    )
    count_tokens(draft, task, event)
    _stamp_use(draft, task, event.at)
    order = draft.own("finished_task_ids")
    order.append(event.task_id)
    if len(order) > MAX_FINISHED_TASKS:
        tasks.pop(order[0], None)
        del order[0]
