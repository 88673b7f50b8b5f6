"""What the master does unasked: time out silent nodes and retire instances that keep failing.

Pure: when each node was last heard from, the time now and the limits come in as arguments.
"""

from __future__ import annotations

from collections.abc import Mapping

from exo.core.events import Event, InstanceDeleted, NodeTimedOut, TaskFinished
from exo.core.ids import InstanceId, NodeId
from exo.core.state import State

DEFAULT_NODE_TIMEOUT_S = 30.0
DEFAULT_MAX_RUNNER_FAILURES = 3


def end_instance(state: State, instance_id: InstanceId, reason: str) -> list[Event]:
    """Delete an instance; its open tasks fail first, so no caller waits for an answer that cannot come."""
    ended: list[Event] = [
        TaskFinished(task_id=t.task_id, status="failed", finish_reason="error", error=f"instance deleted: {reason}")
        for t in state.open_tasks_of(instance_id)
    ]
    return [*ended, InstanceDeleted(instance_id=instance_id, reason=reason)]


def silent_nodes(state: State, heard_at: Mapping[NodeId, float], now: float, timeout: float) -> list[NodeId]:
    """Nodes in State not heard from for `timeout` seconds (a node never heard counts as heard now)."""
    return sorted(n for n in state.nodes if now - heard_at.get(n, now) >= timeout)


def time_out_node(state: State, node_id: NodeId, timeout: float, skip: frozenset[InstanceId] = frozenset()) -> list[Event]:
    """The node leaves State; instances using it (but those in `skip`, deleted already) go first."""
    reason = f"node {node_id} timed out: no heartbeat for {timeout:g} s"
    events: list[Event] = []
    for instance in sorted(state.instances.values(), key=lambda i: i.instance_id):
        if instance.instance_id not in skip and any(shard.node_id == node_id for shard in instance.shards):
            events.extend(end_instance(state, instance.instance_id, reason))
    return [*events, NodeTimedOut(node_id=node_id, reason=reason)]


def _instances_on_missing_nodes(state: State, live: set[NodeId]) -> list[Event]:
    """An instance placed on a node that timed out at the same moment: nothing else would delete it."""
    events: list[Event] = []
    for instance in sorted(state.instances.values(), key=lambda i: i.instance_id):
        gone = sorted({s.node_id for s in instance.shards} - live)
        if gone:
            events.extend(end_instance(state, instance.instance_id, f"node {gone[0]} is no longer in the cluster"))
    return events


def failing_instances(state: State, max_failures: int, skip: frozenset[InstanceId] = frozenset()) -> list[Event]:
    """Instances with a runner that failed `max_failures` times in a row: the worker gave up restarting it."""
    events: list[Event] = []
    for instance in sorted(state.instances.values(), key=lambda i: i.instance_id):
        if instance.instance_id in skip:
            continue
        runners = [state.runners.get(s.runner_id) for s in instance.shards]
        worst = max((r for r in runners if r is not None and r.status == "failed"),
                    key=lambda r: r.failures, default=None)
        if worst is not None and worst.failures >= max_failures:
            reason = f"runner {worst.runner_id} on node {worst.node_id} failed {worst.failures} times: {worst.error}"
            events.extend(end_instance(state, instance.instance_id, reason))
    return events


def supervise(
    state: State, heard_at: Mapping[NodeId, float], now: float, *,
    node_timeout: float = DEFAULT_NODE_TIMEOUT_S, max_runner_failures: int = DEFAULT_MAX_RUNNER_FAILURES,
) -> list[Event]:
    events: list[Event] = []
    for node_id in silent_nodes(state, heard_at, now, node_timeout):
        events.extend(time_out_node(state, node_id, node_timeout, _deleted_by(events)))
    events.extend(_instances_on_missing_nodes(state, set(state.nodes)))
    return [*events, *failing_instances(state, max_runner_failures, _deleted_by(events))]


def _deleted_by(events: list[Event]) -> frozenset[InstanceId]:
    return frozenset(e.instance_id for e in events if isinstance(e, InstanceDeleted))
