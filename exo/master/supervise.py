"""What the master does unasked: time out silent nodes, end instances that lost a node or keep
failing (moving their generations: exo/master/heal.py), keep each desire placed, unload idle ones,
scale replicas with the load (exo/master/autoscale.py) and delete the adapters marked for deletion
once their last request ends (exo/master/adapters.py).

Pure: when each node was last heard from, the time now and the limits come in as arguments.
"""

from __future__ import annotations

import itertools
from collections.abc import Collection, Iterator, Mapping, MutableMapping

from msgspec.structs import replace

from exo.core.events import DesireEnded, Event, InstanceDeleted, NodeSuspected, NodeTimedOut
from exo.core.ids import InstanceId, ModelId, NodeId
from exo.core.node_names import node_display
from exo.core.state import State
from exo.core.types import Instance, ModelCard
from exo.master.adapters import deletions_due
from exo.master.autoscale import ScalePolicy, desires_touched, scale_desires
from exo.master.heal import HealLimits, after_failure, end_instance, replace_missing, waiting_tasks

DEFAULT_NODE_TIMEOUT_S = 30.0
DEFAULT_MAX_RUNNER_FAILURES = 3
DEFAULT_SCALE = ScalePolicy()  # EXO_SCALE_*'s defaults


def silent_nodes(state: State, heard_at: Mapping[NodeId, float], now: float, timeout: float) -> list[NodeId]:
    """Nodes in State not heard from for `timeout` seconds (a node never heard counts as heard now)."""
    return sorted(n for n in state.nodes if now - heard_at.get(n, now) >= timeout)


def seed_heard_at(state: State, heard_at: MutableMapping[NodeId, float], now: float, suspect_s: float) -> None:
    """Nodes this master has not heard yet get a full timeout from `now`; one an earlier master
    marked suspect stays suspect (its silence began before this master)."""
    for node_id, node in state.nodes.items():
        heard_at.setdefault(node_id, now - suspect_s if node.suspect_since else now)


def suspect_marks(state: State, silent: Collection[NodeId], now: float, suspect_s: float, *,
                  may_mark: bool = True) -> list[Event]:
    """Where State's suspect marks differ from `silent` (the nodes not heard for `suspect_s`): a node
    marked once when it falls silent, cleared once when heard again, nothing while they agree.
    `may_mark` False: this round's silence proves nothing (a stalled loop, broker trouble)."""
    events: list[Event] = []
    for node_id, node in sorted(state.nodes.items()):
        if node_id in silent and not node.suspect_since and may_mark:
            events.append(NodeSuspected(node_id=node_id, at=now,
                                        reason=f"node {node_display(state, node_id)} is suspect: no pulse for {suspect_s:g} s"))
        elif node_id not in silent and node.suspect_since:
            events.append(NodeSuspected(node_id=node_id, suspect=False, at=now,
                                        reason=f"node {node_display(state, node_id)} is heard again"))
    return events


def time_out_node(state: State, node_id: NodeId, timeout: float, now: float = 0.0,
                  limits: HealLimits = HealLimits()) -> list[Event]:
    """The node leaves State; instances using it go first (their generations move elsewhere)."""
    reason = f"node {node_display(state, node_id)} timed out: no heartbeat for {timeout:g} s"
    return [*end_instances_on(state, node_id, reason, now, limits), NodeTimedOut(node_id=node_id, reason=reason)]


def end_instances_on(state: State, node_id: NodeId, reason: str, now: float = 0.0,
                     limits: HealLimits = HealLimits()) -> list[Event]:
    """The node is gone: every instance with a rank on it ends, its generations move elsewhere."""
    ending = {i.instance_id: reason for i in _sorted(state) if any(s.node_id == node_id for s in i.shards)}
    return _end_all(state, ending, set(), now, limits, frozenset({node_id}))


def failing_instances(state: State, max_failures: int, skip: frozenset[InstanceId] = frozenset(), now: float = 0.0,
                      limits: HealLimits = HealLimits()) -> list[Event]:
    """Instances with a runner that failed `max_failures` times in a row: the worker gave up restarting it."""
    ending = {i.instance_id: why for i in _sorted(state)
              if i.instance_id not in skip and (why := _failing(state, i, max_failures))}
    return _end_all(state, ending, set(ending), now, limits, frozenset())


def _failing(state: State, instance: Instance, max_failures: int) -> str:
    runners = [state.runners.get(s.runner_id) for s in instance.shards]
    worst = max((r for r in runners if r is not None and r.status == "failed"), key=lambda r: r.failures, default=None)
    if worst is None or worst.failures < max_failures:
        return ""
    return f"runner {worst.runner_id} on node {node_display(state, worst.node_id)} failed {worst.failures} times: {worst.error}"


def supervise(
    state: State, heard_at: Mapping[NodeId, float], now: float, *,
    node_timeout: float = DEFAULT_NODE_TIMEOUT_S, max_runner_failures: int = DEFAULT_MAX_RUNNER_FAILURES,
    wall_now: float | None = None, limits: HealLimits = HealLimits(),
    builtin: Mapping[ModelId, ModelCard] | None = None, ids: Iterator[str] | None = None,
    scale: ScalePolicy = DEFAULT_SCALE,
) -> list[Event]:
    """Instances that lost a node or keep failing end first (their tasks move); once State has
    that, waiting tasks find instances, desires short of replicas get new ones, idle ones unload,
    replicas follow the load and adapters waiting for their requests to end are deleted."""
    wall = now if wall_now is None else wall_now
    timed_out = silent_nodes(state, heard_at, now, node_timeout)
    suspect = frozenset(silent_nodes(state, heard_at, now, min(limits.suspect_s, node_timeout)))
    ending: dict[InstanceId, str] = {}
    failed: set[InstanceId] = set()
    for instance in _sorted(state):
        if why := _lost_node(state, instance, timed_out, suspect, node_timeout, limits.suspect_s):
            ending[instance.instance_id] = why
        elif why := _failing(state, instance, max_runner_failures):
            ending[instance.instance_id] = why
            failed.add(instance.instance_id)
    events = _end_all(state, ending, failed, wall, limits, suspect)
    events += [NodeTimedOut(node_id=n, reason=f"node {node_display(state, n)} timed out: no heartbeat for {node_timeout:g} s")
               for n in timed_out]
    if events:
        return events
    kept = [*waiting_tasks(state, wall, limits, suspect),
            *replace_missing(state, builtin or {}, ids or _no_ids(), wall, avoid=suspect),
            *idle_desires(state, wall), *deletions_due(state)]
    # A desire healed or unloaded this round scales in the next: two whole-record DesireSets of one
    # desire in one round would lose the first's change.
    return [*kept, *scale_desires(state, wall, scale, skip=desires_touched(state, kept))]


def supervision_round(state: State, heard_at: MutableMapping[NodeId, float], now: float, wall: float, *,
                      node_timeout: float, limits: HealLimits, builtin: Mapping[ModelId, ModelCard],
                      scale: ScalePolicy, ids: Iterator[str], quiet: bool) -> list[Event]:
    """One round of the master's supervision: nodes marked suspect, then `supervise`. `quiet`: the
    silence of this round proves nothing (the master's loop stalled, or the broker was in trouble)."""
    suspect_s = min(limits.suspect_s, node_timeout)
    seed_heard_at(state, heard_at, now, suspect_s)
    return [*suspect_marks(state, silent_nodes(state, heard_at, now, suspect_s), wall, suspect_s, may_mark=not quiet),
            *supervise(state, heard_at, now, node_timeout=node_timeout, wall_now=wall,
                       limits=replace(limits, suspect_s=float("inf")) if quiet else limits,
                       builtin=builtin, scale=scale, ids=ids)]


def idle_desires(state: State, now: float) -> list[Event]:
    """Desires idle for their keep_alive end, with their instances (unloaded on every rank). A task
    open on one of its instances, or waiting for its model, keeps it; negative: kept until deleted."""
    by_instance = state.open_tasks_by_instance()
    waited_for = {t.model_id for t in by_instance.get(InstanceId(""), [])}
    events: list[Event] = []
    for desire in sorted(state.desires.values(), key=lambda d: d.desire_id):
        instances = state.instances_of_desire(desire.desire_id)
        idle_s = now - desire.last_used_at
        if (desire.keep_alive_s < 0 or not desire.last_used_at or idle_s < desire.keep_alive_s
                or desire.model_id in waited_for or any(by_instance.get(i.instance_id) for i in instances)
                or any(_loading(state, i) for i in instances)):
            continue
        reason = f"idle for {idle_s:.0f} s (keep_alive {desire.keep_alive_s:g} s)"
        events += [InstanceDeleted(instance_id=i.instance_id, reason=reason) for i in instances]
        events.append(DesireEnded(desire_id=desire.desire_id, reason=reason))
    return events


def _loading(state: State, instance: Instance) -> bool:
    """Still loading: idleness counts from its readiness (the reducer stamps it then), not before."""
    return any((r := state.runners.get(s.runner_id)) is None or r.status not in ("ready", "failed", "stopped")
               for s in instance.shards)


def _lost_node(state: State, instance: Instance, timed_out: list[NodeId], suspect: frozenset[NodeId],
               node_timeout: float, suspect_s: float) -> str:
    for shard in instance.shards:
        if shard.node_id not in state.nodes:
            return f"node {node_display(state, shard.node_id)} is no longer in the cluster"
        if shard.node_id in timed_out:
            return f"node {node_display(state, shard.node_id)} timed out: no heartbeat for {node_timeout:g} s"
        if shard.node_id in suspect:
            return f"node {node_display(state, shard.node_id)} is suspect: no pulse for {suspect_s:g} s"
    return ""


def _end_all(state: State, ending: dict[InstanceId, str], failed: set[InstanceId], now: float, limits: HealLimits,
             lost: frozenset[NodeId]) -> list[Event]:
    events: list[Event] = []
    for instance_id, reason in ending.items():
        if instance_id in failed:
            events += after_failure(state, instance_id, now, limits)
        events += end_instance(state, instance_id, reason, now, limits, frozenset(ending), lost)
    return events


def _sorted(state: State) -> list[Instance]:
    return sorted(state.instances.values(), key=lambda i: i.instance_id)


def _no_ids() -> Iterator[str]:
    return (f"unnamed-{n}" for n in itertools.count())
