"""Replicas that follow the load: a desire with min_replicas and max_replicas gains a replica
while its queue stays long, and loses one once it is idle (docs/models.md, "Replicas that follow
the load").

The signal is the queue: the rows of the desire's pending tasks (not yet started by a runner, or
waiting for an instance of its model) per ready replica; a request of n choices (or best_of
candidates) is n rows of a batch (requests.rows_of), as admission and the worker's slots count it.
It is in State, so the decision is deterministic and replays; a master has no timings to judge
latency by. The window's start (`pressure_since`) and
the latest step (`last_scaled_at`) are in State too: a new master keeps counting where the last
one was. Scaling up only raises `replicas`; exo/master/heal.py places the missing instance.

Pure: State, the wall clock and the policy come in.
"""

from __future__ import annotations

from collections.abc import Iterable

import msgspec
from msgspec.structs import replace

from exo.core.events import DesireEnded, DesireScaled, DesireSet, Event, InstanceCreated, InstanceDeleted
from exo.core.groups import group_of
from exo.core.ids import InstanceId
from exo.core.requests import rows_of
from exo.core.state import State
from exo.core.types import Desire, Instance, Task
from exo.settings.services import MasterSettings

_DEFAULTS = MasterSettings()


class ScalePolicy(msgspec.Struct, frozen=True, kw_only=True):
    """EXO_SCALE_QUEUE, EXO_SCALE_WINDOW_S and EXO_SCALE_IDLE_S (exo/settings/services.py)."""

    queue: int = _DEFAULTS.scale_queue  # pending rows per ready replica above which one is added; 0: no scaling
    window_s: float = _DEFAULTS.scale_window_s  # the queue stays above the target this long first; and between steps
    idle_s: float = _DEFAULTS.scale_idle_s  # without tasks this long, a replica above min_replicas goes


def scale_desires(state: State, now: float, policy: ScalePolicy,
                  skip: frozenset[str] = frozenset()) -> list[Event]:
    """Each scalable desire's next step, if due: the window opened or closed (a DesireSet), a
    replica more or less (DesireScaled, with the instance it unloads). Desires in `skip` (others
    changed them in the same decision) wait for the next round."""
    if policy.queue <= 0:
        return []
    by_instance = state.open_tasks_by_instance()
    events: list[Event] = []
    for desire in sorted(state.desires.values(), key=lambda d: d.desire_id):
        # A master group's model: its queue is in the group's log, not here; it would look idle.
        grouped = bool(group_of(desire.model_id, state.groups))
        if (desire.desire_id not in skip and not grouped and desire.min_replicas is not None
                and desire.max_replicas is not None):
            events += _scale(state, desire, by_instance, now, policy)
    return events


def desires_touched(state: State, events: Iterable[Event]) -> frozenset[str]:
    """The desires the events make, change or end, or whose instances they place or delete."""
    touched: set[str] = set()
    for event in events:
        if isinstance(event, DesireSet):
            touched.add(event.desire.desire_id)
        elif isinstance(event, DesireEnded):
            touched.add(event.desire_id)
        elif isinstance(event, InstanceCreated):
            touched.add(event.instance.desire_id)
        elif isinstance(event, InstanceDeleted) and (instance := state.instances.get(event.instance_id)):
            touched.add(instance.desire_id)
    return frozenset(touched)


def _scale(state: State, desire: Desire, by_instance: dict[InstanceId, list[Task]], now: float,
           policy: ScalePolicy) -> list[Event]:
    instances = state.instances_of_desire(desire.desire_id)
    waiting = [t for t in by_instance.get(InstanceId(""), []) if t.model_id == desire.model_id]
    queued = [t for i in instances for t in by_instance.get(i.instance_id, []) if t.status == "pending"]
    pending = sum(rows_of(t.params) for t in [*waiting, *queued])
    ready = sum(state.is_ready(i) for i in instances)
    if desire.replicas == 0:  # scaled to none: a request brings one back at once, as on demand
        return [_scaled(desire, 1, "a request waits and no replica runs", now)] if waiting else []
    # Only once every replica is ready: one still loading would count as pressure and add another.
    if ready >= desire.replicas and pending > policy.queue * ready:
        # At max_replicas no window opens: nothing would come of it but events.
        return _pressed(desire, pending, now, policy) if desire.replicas < (desire.max_replicas or 0) else []
    if desire.pressure_since:
        return [DesireSet(desire=replace(desire, pressure_since=0.0))]
    return _idle_step(state, desire, instances, by_instance, bool(waiting), now, policy)


def _pressed(desire: Desire, pending: int, now: float, policy: ScalePolicy) -> list[Event]:
    if not desire.pressure_since:
        return [DesireSet(desire=replace(desire, pressure_since=now))]
    held = now - desire.pressure_since
    if held < policy.window_s:
        return []
    return [_scaled(desire, desire.replicas + 1,
                    f"{pending} pending, over {policy.queue} per replica for {held:.0f} s", now)]


def _idle_step(state: State, desire: Desire, instances: list[Instance], by_instance: dict[InstanceId, list[Task]],
               waited_for: bool, now: float, policy: ScalePolicy) -> list[Event]:
    """One replica fewer, if the desire saw no task for idle_s and the last step is a window ago:
    the least recently used instance with no open task goes (never one with work)."""
    floor = desire.min_replicas or 0
    if desire.keep_alive_s >= 0:
        floor = max(floor, 1)  # its keep_alive unloads the last one, with the desire (supervise.idle_desires)
    idle_s = now - desire.last_used_at
    if (desire.replicas <= floor or waited_for or not desire.last_used_at or idle_s < policy.idle_s
            or now - desire.last_scaled_at < policy.window_s):
        return []
    fewer = desire.replicas - 1
    step = _scaled(desire, fewer, f"idle for {idle_s:.0f} s", now)
    if len(instances) <= fewer:  # short of its replicas already (one could not be placed): none to unload
        return [step]
    victim = _least_recently_used(state, [i for i in instances if not by_instance.get(i.instance_id)])
    if victim is None:
        return []
    return [step, InstanceDeleted(instance_id=victim.instance_id, reason=f"scaled down: idle for {idle_s:.0f} s")]


def _least_recently_used(state: State, candidates: list[Instance]) -> Instance | None:
    """The one given a task longest ago (or never), the earliest placed among equals."""
    last_task_at: dict[InstanceId, float] = {}
    for task in state.tasks.values():
        last_task_at[task.instance_id] = max(last_task_at.get(task.instance_id, 0.0), task.created_at)
    return min(candidates, key=lambda i: (last_task_at.get(i.instance_id, 0.0), i.created_seq, i.instance_id),
               default=None)


def _scaled(desire: Desire, to_replicas: int, reason: str, now: float) -> DesireScaled:
    return DesireScaled(desire_id=desire.desire_id, from_replicas=desire.replicas, to_replicas=to_replicas,
                        reason=reason, at=now)
