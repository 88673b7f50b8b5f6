"""What a worker does next: a pure function of State and what this node has locally.

For each runner assigned to this node the lifecycle runs create -> download -> load ->
warm up -> ready; only a ready runner is given generation tasks. A phase that is in progress
("downloading", ...) yields no step, so calling `plan` again while it runs repeats nothing.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from exo.core.events import (
    AnyEvent,
    DownloadDeleted,
    DownloadFailed,
    DownloadProgressed,
    NodeHeartbeat,
    NodeRegistered,
    NodeTimedOut,
    RunnerStatusChanged,
    TaskCancelRequested,
    TaskCreated,
    TaskFinished,
    TaskStarted,
)
from exo.core.ids import InstanceId, ModelId, NodeId, RunnerId, TaskId
from exo.core.state import State
from exo.core.types import Instance, RunnerInfo, ShardAssignment, Task, TaskStatus
from exo.worker.fairness import next_to_forward

LocalPhase = Literal[
    "spawning", "spawned", "downloading", "downloaded", "loading", "loaded", "warming_up", "ready", "failed", "stopping"
]


class LocalRunner(msgspec.Struct, frozen=True, kw_only=True):
    runner_id: RunnerId
    instance_id: InstanceId
    phase: LocalPhase = "spawning"
    forwarded: frozenset[TaskId] = frozenset()  # task ids handed to the runner process
    cancels_sent: frozenset[TaskId] = frozenset()
    expected: frozenset[TaskId] = frozenset()  # a prefill runner: tasks whose prompt cache it was told to serve
    prefill_port: int = 0  # a prefill runner: where it serves prompt caches (0: it does not)
    error: str = ""  # why it failed, told to the callers of the tasks it cannot serve
    failures: int = 0  # its own failures since it was last ready (a peer's failure does not count)
    failed_at: float = 0.0  # the worker's clock when it failed: restarts back off from here
    restartable: bool = True  # False when restarting cannot help (e.g. the model is not on the Hub)
    heard_at: float = 0.0  # the worker's clock at the runner's latest report (it sends Alive every second)


class WorkerView(msgspec.Struct, frozen=True, kw_only=True):
    node_id: NodeId
    state: State
    runners: dict[RunnerId, LocalRunner] = {}
    ended_tasks: frozenset[TaskId] = frozenset()  # tasks whose end this node already reported
    # Tasks this node's runners were given before the worker restarted, with the run they were given
    # (forward_journal.py): that run was begun, perhaps streamed from, and lost with those runners.
    given_before_restart: dict[TaskId, int] = {}
    local_images: frozenset[str] = frozenset()  # sha256 of images on this node's disk
    images_in_flight: frozenset[str] = frozenset()  # being fetched right now
    now: float = 0.0  # the worker's clock (time.monotonic()), for restart back-off
    max_failures: int = 3  # restarts stop here; the master then deletes the instance
    stall_after: float = 30.0  # a runner with work that is silent this long is hung (EXO_RUNNER_STALL_S)
    # A multi-node instance's runner that failed may have lost a peer machine: its tasks wait this
    # long for the master to move them (exo/master/heal.py) before this node ends them with the error.
    migrate_grace: float = 0.0
    batch_slots: int = 0  # rows a runner is given at once (its batch: exo/worker/fairness.py); 0: every task


class Step(msgspec.Struct, frozen=True, kw_only=True, tag_field="step"):
    pass


class StopRunner(Step, frozen=True, tag="stop_runner", kw_only=True):
    runner_id: RunnerId


class CreateRunner(Step, frozen=True, tag="create_runner", kw_only=True):
    runner_id: RunnerId
    instance_id: InstanceId


class DownloadModel(Step, frozen=True, tag="download_model", kw_only=True):
    runner_id: RunnerId
    model_id: ModelId


class LoadModel(Step, frozen=True, tag="load_model", kw_only=True):
    runner_id: RunnerId
    model_id: ModelId


class WarmUpRunner(Step, frozen=True, tag="warm_up", kw_only=True):
    runner_id: RunnerId


class RestartRunner(Step, frozen=True, tag="restart_runner", kw_only=True):
    """Start a failed runner again, after its back-off."""

    runner_id: RunnerId
    instance_id: InstanceId


class KillHungRunner(Step, frozen=True, tag="kill_hung_runner", kw_only=True):
    """It has work and has not shown progress for `stall_after`: fail it (its requests get the
    reason), kill it, and let the restart rules bring it back."""

    runner_id: RunnerId
    reason: str


class AbandonRunner(Step, frozen=True, tag="abandon_runner", kw_only=True):
    """Stop this rank because a peer rank failed: the group must form again from scratch."""

    runner_id: RunnerId
    reason: str


class ForwardTask(Step, frozen=True, tag="forward_task", kw_only=True):
    runner_id: RunnerId
    task_id: TaskId


class CancelForwardedTask(Step, frozen=True, tag="cancel_task", kw_only=True):
    runner_id: RunnerId
    task_id: TaskId


class ExpectPrefillTask(Step, frozen=True, tag="expect_prefill", kw_only=True):
    """Tell a prefill runner that a task's decoding runner will ask it for the prompt's cache."""

    runner_id: RunnerId
    task_id: TaskId


class FetchImages(Step, frozen=True, tag="fetch_images", kw_only=True):
    digests: list[str]


class EndTask(Step, frozen=True, tag="end_task", kw_only=True):
    """End a task that no runner will finish: cancelled before it ran, or its runner failed."""

    task_id: TaskId
    status: TaskStatus
    reason: str


_NEXT_LIFECYCLE_STEP = {"spawned": DownloadModel, "downloaded": LoadModel, "loaded": WarmUpRunner}


def plan(view: WorkerView) -> list[Step]:
    steps: list[Step] = [*_stop_orphans(view)]
    if fetch := images_to_fetch(view):
        steps.append(FetchImages(digests=fetch))
    shards = _my_shards(view)
    open_tasks = view.state.open_tasks_by_instance() if shards else {}
    for instance, shard in shards:
        local = view.runners.get(shard.runner_id)
        if local is None:
            steps.append(CreateRunner(runner_id=shard.runner_id, instance_id=instance.instance_id))
            continue
        steps.extend(_lifecycle_steps(view, instance, local))
        if shard.rank == 0:  # the other ranks follow rank 0; only it is given tasks
            steps.extend(_task_steps(view, instance, local, open_tasks.get(instance.instance_id, [])))
        if instance.role == "prefill" and local.phase == "ready":
            steps.extend(_prefill_steps(instance, local, open_tasks))
    return steps


def _prefill_steps(instance: Instance, local: LocalRunner, open_tasks: dict[InstanceId, list[Task]]) -> list[Step]:
    """The first runs, not yet begun, that will ask this prefill runner for their prompt's cache."""
    return [ExpectPrefillTask(runner_id=local.runner_id, task_id=t.task_id)
            for tasks in open_tasks.values() for t in tasks
            if t.prefill_instance == instance.instance_id and t.status == "pending" and not t.migrations
            and t.task_id not in local.expected]


# Local phases in which a runner is (or is joining) its group: a failed peer breaks it.
_IN_GROUP = frozenset({"loading", "loaded", "warming_up", "ready"})
# A peer's status from which it can join the group: downloaded, or further along.
_READY_TO_CONNECT = frozenset({"downloaded", "loading", "warming_up", "ready"})


def _lifecycle_steps(view: WorkerView, instance: Instance, local: LocalRunner) -> list[Step]:
    peers = [view.state.runners.get(s.runner_id) for s in instance.shards if s.runner_id != local.runner_id]
    failed_peer = next((p for p in peers if p is not None and p.status == "failed"), None)
    if failed_peer is not None and local.phase in _IN_GROUP:
        reason = f"peer runner {failed_peer.runner_id} on node {failed_peer.node_id} failed: {failed_peer.error}"
        return [AbandonRunner(runner_id=local.runner_id, reason=reason)]
    if local.phase == "ready" and busy(view, local) and view.now - local.heard_at > view.stall_after:
        silent = view.now - local.heard_at
        return [KillHungRunner(runner_id=local.runner_id, reason=f"no progress for {silent:.0f} s while generating")]
    if local.phase == "failed":
        if local.restartable and local.failures < view.max_failures and view.now >= restart_due(local):
            return [RestartRunner(runner_id=local.runner_id, instance_id=instance.instance_id)]
        return []
    lifecycle = _NEXT_LIFECYCLE_STEP.get(local.phase)
    if lifecycle is WarmUpRunner:
        return [WarmUpRunner(runner_id=local.runner_id)]
    if lifecycle is LoadModel and peers and not _can_form_group(view, peers):
        return []
    if lifecycle is not None:
        return [lifecycle(runner_id=local.runner_id, model_id=instance.model_id)]
    return []


def settled(state: State, ended: set[TaskId] | frozenset[TaskId]) -> set[TaskId]:
    """Ended tasks whose end State already has (or that State no longer keeps): neither the
    ended set nor a runner's forwarded set needs them any more, so both stay bounded on a
    long-lived node. A task whose end State has not folded yet stays: it is still open there."""
    return {t for t in ended if (task := state.tasks.get(t)) is None or task.status not in ("pending", "running")}


def busy(view: WorkerView, local: LocalRunner) -> bool:
    """It was given tasks that have not ended."""
    return bool(local.forwarded - view.ended_tasks)


def _can_form_group(view: WorkerView, peers: list[RunnerInfo | None]) -> bool:
    """Every rank can join, and no runner of this node is still leaving: a deleted instance's
    runner may still hold the ring port the new group was given."""
    stopping = any(r.phase == "stopping" for r in view.runners.values())
    return not stopping and all(p is not None and p.status in _READY_TO_CONNECT for p in peers)


def restart_due(local: LocalRunner) -> float:
    """Back-off: 1 s after the first failure, doubling, at most 30 s; a peer's failure: 1 s."""
    return local.failed_at + min(30.0, 2.0 ** max(local.failures - 1, 0))


def _stop_orphans(view: WorkerView) -> list[Step]:
    return [
        StopRunner(runner_id=r.runner_id)
        for r in view.runners.values()
        if r.instance_id not in view.state.instances and r.phase != "stopping"
    ]


def _my_shards(view: WorkerView) -> list[tuple[Instance, ShardAssignment]]:
    return [(i, s) for i in view.state.instances.values() for s in i.shards if s.node_id == view.node_id]


def _task_steps(view: WorkerView, instance: Instance, local: LocalRunner, tasks: list[Task]) -> list[Step]:
    steps: list[Step] = []
    waiting: list[Task] = []  # pending, not yet given to the runner, ready to be
    held = len(instance.shards) > 1 and local.failed_at > 0 and view.now - local.failed_at < view.migrate_grace \
        and not _a_peer_failed(view, instance, local)
    for task in tasks:
        if task.task_id in view.ended_tasks:
            continue
        forwarded = task.task_id in local.forwarded
        begun_before = task.status == "running" or view.given_before_restart.get(task.task_id, -1) >= len(task.migrations)
        if local.phase == "failed" or (begun_before and not forwarded):
            if held:  # the master may move it to another instance: its generation goes on there
                continue
            reason = ("its runner restarted mid-generation" if local.phase != "failed" else
                      f"the runner serving it failed: {local.error}" if local.error else "the runner serving it failed")
            steps.append(EndTask(task_id=task.task_id, status="failed", reason=reason))
        elif task.cancel_requested and not forwarded:
            steps.append(EndTask(task_id=task.task_id, status="cancelled",
                                 reason=task.cancel_reason or "cancelled before it started"))
        elif task.cancel_requested and task.task_id not in local.cancels_sent:
            steps.append(CancelForwardedTask(runner_id=local.runner_id, task_id=task.task_id))
        elif local.phase == "ready" and not forwarded and not missing_images(view, task):
            waiting.append(task)
    return steps + _forwards(view, instance, local, tasks, waiting)


def _forwards(view: WorkerView, instance: Instance, local: LocalRunner, tasks: list[Task],
              waiting: list[Task]) -> list[Step]:
    """The waiting tasks the runner is given now: as many as its batch has free rows for, fairly."""
    if not view.batch_slots:
        return [ForwardTask(runner_id=local.runner_id, task_id=t.task_id) for t in waiting]
    in_runner = [t for t in tasks if t.task_id in local.forwarded and t.task_id not in view.ended_tasks]
    # The single path (a quantized KV cache, a draft model) serves one at a time: one slot.
    slots = 1 if instance.kv_bits or instance.draft_model else view.batch_slots
    chosen = next_to_forward(waiting, in_runner, slots)
    return [ForwardTask(runner_id=local.runner_id, task_id=t.task_id) for t in chosen]


def _a_peer_failed(view: WorkerView, instance: Instance, local: LocalRunner) -> bool:
    """A peer rank's worker said its runner failed or stopped: that machine is alive, so the
    failure is a runner's, not a lost machine's (whose worker would say nothing)."""
    peers = (view.state.runners.get(s.runner_id) for s in instance.shards if s.runner_id != local.runner_id)
    return any(p is not None and p.status in ("failed", "stopped") for p in peers)


def nodes_concerned(state: State, event: AnyEvent) -> frozenset[NodeId] | None:
    """The nodes whose plan `event` (already folded into `state`) can change; None: any node's.

    A busy cluster's events are mostly one instance's task and runner events: only the nodes that
    instance runs on need to plan again. (With every node planning on every event, a worker's
    cost grew with the whole cluster's traffic; see docs/scaling.md.)"""
    match event:
        case TaskCreated() if event.task.prefill_instance:  # its prefill runner expects it too
            decoding, prefilling = _nodes_of(state, event.task.instance_id), _nodes_of(state, event.task.prefill_instance)
            return None if decoding is None or prefilling is None else decoding | prefilling
        case TaskCreated():
            return _nodes_of(state, event.task.instance_id)
        case TaskStarted() | TaskFinished() | TaskCancelRequested():
            task = state.tasks.get(event.task_id)
            return None if task is None else _nodes_of(state, task.instance_id)
        case RunnerStatusChanged():
            return _nodes_of(state, event.instance_id)
        case NodeRegistered() | NodeHeartbeat():
            return frozenset({event.node.node_id})
        case DownloadProgressed():
            return frozenset({event.progress.node_id})
        case NodeTimedOut() | DownloadFailed() | DownloadDeleted():
            return frozenset({event.node_id})
    return None


def _nodes_of(state: State, instance_id: InstanceId) -> frozenset[NodeId] | None:
    instance = state.instances.get(instance_id)
    return None if instance is None else frozenset(shard.node_id for shard in instance.shards)


def images_of(task: Task) -> list[str]:
    """The objects of exo-images the task's runner reads: its messages' images, or its audio."""
    audio = [task.params.transcribe.audio] if task.params.transcribe is not None else []
    return [digest for message in task.params.messages for digest in message.images] + audio


def missing_images(view: WorkerView, task: Task) -> list[str]:
    return [d for d in images_of(task) if d not in view.local_images]


def tasks_needing(view: WorkerView, digest: str) -> list[TaskId]:
    """This node's pending tasks, not yet ended, that need the image: those a failed fetch fails."""
    return [task.task_id for task in _my_open_tasks(view)
            if task.status == "pending" and task.task_id not in view.ended_tasks and digest in images_of(task)]


def images_needed(view: WorkerView) -> set[str]:
    """Images of this node's pending and running tasks: the image cache must not evict them."""
    return {d for task in _my_open_tasks(view) for d in images_of(task)}


def images_to_fetch(view: WorkerView) -> list[str]:
    """Images of this node's open tasks that it lacks and is not already fetching, in order."""
    wanted: dict[str, None] = {}
    for task in _my_open_tasks(view):
        if task.task_id not in view.ended_tasks:
            wanted.update((d, None) for d in missing_images(view, task) if d not in view.images_in_flight)
    return list(wanted)


def images_of_waiting_tasks(view: WorkerView) -> list[str]:
    """Images of the open tasks that wait for an instance (theirs was lost, a desire will place
    another), missing here: a late joiner fetches them before it plans, since the replacement may
    well be placed on it (the caller bounds them by the image cache)."""
    wanted: dict[str, None] = {}
    for task in view.state.tasks.values():
        waiting = task.status == "pending" and task.instance_id not in view.state.instances
        if waiting and task.task_id not in view.ended_tasks:
            wanted.update((d, None) for d in missing_images(view, task) if d not in view.images_in_flight)
    return list(wanted)


def _my_open_tasks(view: WorkerView) -> list[Task]:
    """Open tasks of the instances this node has a shard of, instance by instance."""
    shards = _my_shards(view)
    if not shards:
        return []
    open_tasks = view.state.open_tasks_by_instance()
    return [task for instance, _ in shards for task in open_tasks.get(instance.instance_id, [])]
