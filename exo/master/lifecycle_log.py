"""The master's INFO lines for a model's and a node's lifecycle, each read off one event with the
State before it: nodes joined, suspect, back or gone; instances placed (and why), loading, ready,
failed, moved from and unloaded; desires scaled. Nodes are named by their label, as the dashboard
names them; each line's ids ride along as fields (`extra=`) for EXO_LOG_FORMAT=json."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from exo.core.events import (
    AnyEvent,
    DesireEnded,
    DesireScaled,
    DesireSet,
    InstanceCreated,
    InstanceDeleted,
    NodeHeartbeat,
    NodeRegistered,
    NodeRemoved,
    NodeSuspected,
    NodeTimedOut,
    RunnerStatusChanged,
    TaskMigrated,
)
from exo.core.ids import InstanceId, NodeId
from exo.core.node_names import node_display
from exo.core.state import State
from exo.core.types import Desire, Instance

log = logging.getLogger("exo.master.service")


@dataclass(frozen=True)
class Line:
    message: str
    fields: dict[str, str]  # the ids the line names: fields of their own in JSON log lines
    level: int = logging.INFO


@dataclass
class Recall:
    """What a line needs from earlier events."""

    placed_why: dict[str, str] = field(default_factory=dict)  # desire id -> why its next instance is placed
    placed_at: dict[InstanceId, float] = field(default_factory=dict)  # instance id -> when (the caller's clock)
    warm_up_s: dict[InstanceId, float] = field(default_factory=dict)  # the longest warm-up of its ranks ready so far


def lifecycle_lines(before: State, event: AnyEvent, after: State, recall: Recall, now: float) -> list[Line]:
    """The lines one event tells, given State before and after it; `recall` is updated as it goes."""
    match event:
        case NodeRegistered() | NodeHeartbeat() if event.node.node_id not in before.nodes:
            return [Line(f"master: node {_label(after, event.node.node_id)} joined", {"node_id": event.node.node_id})]
        case NodeTimedOut():
            why = event.reason.removeprefix(f"node {_label(before, event.node_id)} ")  # the reason names it
            return [Line(f"master: node {_label(before, event.node_id)} gone: {why}", {"node_id": event.node_id},
                         logging.WARNING)]
        case NodeRemoved() if event.node_id in before.nodes and event.node_id not in after.nodes:  # not skipped
            return [Line(f"master: node {_label(before, event.node_id)} removed by {event.removed_by or 'an admin'}"
                         f"{': ' + event.reason if event.reason else ''}", {"node_id": event.node_id}, logging.WARNING)]
        case NodeSuspected() if _marked(before, event.node_id) != _marked(after, event.node_id):  # not skipped
            return [_suspected(after, event)]
        case InstanceCreated():
            recall.placed_at[event.instance.instance_id] = now
            if event.instance.desire_id not in before.desires:
                return []  # a new placement: its DesireSet, next, says whether on demand
            why = recall.placed_why.pop(event.instance.desire_id, "by request")
            return [_placed(before, event.instance, why)]
        case DesireSet() if event.desire.desire_id not in before.desires:
            why = "on demand" if event.desire.on_demand else "by request"
            return [_placed(after, i, why) for i in after.instances_of_desire(event.desire.desire_id)]
        case DesireScaled():
            return _scaled(before, event, recall)
        case DesireEnded():
            recall.placed_why.pop(event.desire_id, None)
        case RunnerStatusChanged():
            return _runner_changed(before, event, after, recall, now)
        case InstanceDeleted() if (instance := before.instances.get(event.instance_id)) is not None:
            return _unloaded(instance, event, before, after, recall)
        case TaskMigrated() if (task := before.tasks.get(event.task_id)) is not None:
            source = _where(before, task.instance_id) if task.instance_id else "its queue"
            target = _where(before, event.to_instance) if event.to_instance else "the queue (no instance yet)"
            return [Line(f"master: moved task {task.task_id} of {task.model_id} from {source} to {target}: "
                         f"{_named(before, event.reason)}", {"task_id": task.task_id, "model": task.model_id})]
    return []


def _marked(state: State, node_id: NodeId) -> bool:
    node = state.nodes.get(node_id)
    return node is not None and node.suspect_since > 0


def _suspected(state: State, event: NodeSuspected) -> Line:
    label = _label(state, event.node_id)
    if not event.suspect:
        return Line(f"master: node {label} back", {"node_id": event.node_id})
    why = event.reason.removeprefix(f"node {label} is suspect: ")  # the reason names it
    return Line(f"master: node {label} suspect: {why}", {"node_id": event.node_id}, logging.WARNING)


def _placed(state: State, instance: Instance, why: str) -> Line:
    return Line(f"master: placed {instance.model_id} on {_nodes(state, instance)}: {why} (instance "
                f"{instance.instance_id})", _ids(instance))


def _scaled(before: State, event: DesireScaled, recall: Recall) -> list[Line]:
    desire = before.desires.get(event.desire_id)
    if desire is None:
        return []
    if event.to_replicas > event.from_replicas:
        recall.placed_why[desire.desire_id] = f"scaled from {event.from_replicas} to {event.to_replicas} replicas"
    return [Line(f"master: scaled {desire.model_id} from {event.from_replicas} to {event.to_replicas} replica(s): "
                 f"{event.reason}", {"model": desire.model_id})]


def _runner_changed(before: State, event: RunnerStatusChanged, after: State, recall: Recall, now: float) -> list[Line]:
    instance = after.instances.get(event.instance_id)
    runner = before.runners.get(event.runner_id)
    if instance is None or runner is None:
        return []
    on = {**_ids(instance), "node_id": event.node_id}
    if event.status == "loading" and runner.status != "loading":
        return [Line(f"master: {instance.model_id} loading on {_label(after, event.node_id)} (instance "
                     f"{instance.instance_id})", on)]
    if event.status == "failed":
        return [Line(f"master: {instance.model_id} failed on {_label(after, event.node_id)}: {event.error} (instance "
                     f"{instance.instance_id}, failure {event.failures})", on, logging.WARNING)]
    if event.status == "ready":
        return _ready(before, event, after, instance, recall, now)
    return []


def _ready(before: State, event: RunnerStatusChanged, after: State, instance: Instance, recall: Recall,
           now: float) -> list[Line]:
    """The line once every rank is ready, with the slowest rank's warm-up (its kernel compiles)."""
    if before.is_ready(instance):
        return []
    warm_up_s = max(recall.warm_up_s.pop(instance.instance_id, 0.0), event.warm_up_s)
    if not after.is_ready(instance):
        recall.warm_up_s[instance.instance_id] = warm_up_s  # the ranks still loading say theirs next
        return []
    placed_at = recall.placed_at.get(instance.instance_id)
    took = f" in {now - placed_at:.1f} s from placement" if placed_at is not None else ""
    warmed = f", warm-up {warm_up_s:.2f} s" if warm_up_s else ""  # 0: a worker that does not say
    return [Line(f"master: {instance.model_id} ready on {_nodes(after, instance)}{took} (instance "
                 f"{instance.instance_id}{warmed})", _ids(instance))]


def _unloaded(instance: Instance, event: InstanceDeleted, before: State, after: State, recall: Recall) -> list[Line]:
    recall.placed_at.pop(instance.instance_id, None)
    recall.warm_up_s.pop(instance.instance_id, None)
    reason = _named(before, event.reason)
    desire: Desire | None = after.desires.get(instance.desire_id)
    if desire is not None and len(after.instances_of_desire(desire.desire_id)) < desire.replicas:
        recall.placed_why[desire.desire_id] = f"replacing instance {instance.instance_id} ({reason})"
    return [Line(f"master: unloaded {instance.model_id} from {_nodes(before, instance)}: {reason} (instance "
                 f"{instance.instance_id})", _ids(instance))]


def _ids(instance: Instance) -> dict[str, str]:
    return {"model": instance.model_id, "instance_id": instance.instance_id}


def _label(state: State, node_id: NodeId) -> str:
    return node_display(state, node_id)


def _named(state: State, reason: str) -> str:
    """Reasons written before the deciders named nodes name them by id: here, by name."""
    for node_id in state.nodes:
        reason = reason.replace(node_id, node_display(state, node_id)) if node_id in reason else reason
    return reason


def _nodes(state: State, instance: Instance) -> str:
    return ", ".join(dict.fromkeys(_label(state, s.node_id) for s in instance.shards)) or "no node"


def _where(state: State, instance_id: InstanceId) -> str:
    instance = state.instances.get(instance_id)
    return f"{_nodes(state, instance)} (instance {instance_id})" if instance is not None else f"instance {instance_id}"


class LifecycleLog:
    """A State listener that logs `lifecycle_lines` while `leading()` (one node tells the cluster's
    story); it keeps the State before each event, and recalls what later lines need all along."""

    def __init__(self, state: State, leading: Callable[[], bool], clock: Callable[[], float] = time.monotonic) -> None:
        self._before = state
        self._leading = leading
        self._clock = clock
        self._recall = Recall()

    def on_event(self, seq: int, event: AnyEvent, state: State) -> None:
        before, self._before = self._before, state
        lines = lifecycle_lines(before, event, state, self._recall, self._clock())
        if self._leading():
            _emit(lines)


def _emit(lines: list[Line]) -> None:
    for line in lines:
        log.log(line.level, "%s", line.message, extra=line.fields)
