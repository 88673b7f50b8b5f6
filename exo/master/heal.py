"""Self-healing: desires kept placed, and generations moved off instances that died.

A placement is a Desire in State: the master keeps `replicas` instances of it running. An
instance that loses a node (timed out, or suspect: its pulses stopped for a few seconds) or fails
for good is ended, and its open tasks are migrated: to another instance of the same model at
once, else they wait (instance "") for the desire's replacement, up to a deadline. The runner
that takes a task over prefills the prompt plus the tokens already streamed (EXO_TOKENS) and
continues; chunk indices continue (exo/worker/service.py, exo/runner/engine.py).

Pure: State, the time (wall clock, as tasks and desires keep it), ids and limits come in.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import msgspec
from msgspec.structs import replace

from exo.core.catalogue import adapter_of, find_card
from exo.core.events import DesireSet, Event, InstanceCreated, InstanceDeleted, TaskFinished, TaskMigrated
from exo.core.ids import CommandId, InstanceId, ModelId, NodeId
from exo.core.placement import Unplaceable, place_instance
from exo.core.state import State
from exo.core.types import Desire, Instance, ModelCard, Task


class HealLimits(msgspec.Struct, frozen=True, kw_only=True):
    suspect_s: float = 5.0  # pulses silent this long: the node's instances are lost (it may come back)
    deadline_s: float = 120.0  # a migrated task waits this long for an instance of its model
    max_migrations: int = 2  # moves per task; past them it ends with the reason
    backoff_max_s: float = 60.0  # the longest wait before replacing an instance that kept failing
    load_timeout_s: float = 300.0  # a request waits this long for an instance of its model placed on demand


def backoff_s(failures: int, limits: HealLimits) -> float:
    return min(limits.backoff_max_s, 2.0 ** failures)


def end_instance(state: State, instance_id: InstanceId, reason: str, now: float, limits: HealLimits,
                 ending: frozenset[InstanceId] = frozenset(), lost: frozenset[NodeId] = frozenset()) -> list[Event]:
    """Delete an instance that died; its open tasks move to another instance of the model (or
    wait for one), so no caller gets an error for a machine that went away."""
    instance = state.instances[instance_id]
    events: list[Event] = [_moved_or_ended(state, task, instance, reason, now, limits, ending | {instance_id}, lost)
                           for task in state.open_tasks_of(instance_id)]
    return [*events, InstanceDeleted(instance_id=instance_id, reason=reason)]


def _moved_or_ended(state: State, task: Task, instance: Instance, reason: str, now: float, limits: HealLimits,
                    ending: frozenset[InstanceId], lost: frozenset[NodeId]) -> Event:
    if task.cancel_requested:
        return TaskFinished(task_id=task.task_id, status="cancelled", finish_reason="cancelled",
                            error=f"instance deleted: {reason}")
    if len(task.migrations) >= limits.max_migrations:
        return TaskFinished(task_id=task.task_id, status="failed", finish_reason="error",
                            error=f"instance deleted: {reason}; the generation was moved {len(task.migrations)} "
                                  f"time(s) already, the most allowed (EXO_MAX_MIGRATIONS)")
    target = usable_instance(state, instance.model_id, ending, lost)
    if target is None and instance.desire_id not in state.desires:  # nothing will place another
        return TaskFinished(task_id=task.task_id, status="failed", finish_reason="error", error=f"instance deleted: {reason}")
    to = target.instance_id if target is not None else InstanceId("")
    return TaskMigrated(task_id=task.task_id, to_instance=to, reason=f"instance {instance.instance_id}: {reason}", at=now)


def usable_instance(state: State, model_id: ModelId, ending: frozenset[InstanceId] = frozenset(),
                    lost: frozenset[NodeId] = frozenset()) -> Instance | None:
    """The least busy instance of the model that can take a task: none of its runners failed,
    none of its ranks on a lost node, not being ended."""
    open_tasks = state.open_tasks_by_instance()
    candidates = [i for i in state.instances_of(model_id)
                  if i.instance_id not in ending and not any(s.node_id in lost for s in i.shards)
                  and not any((r := state.runners.get(s.runner_id)) is not None and r.status == "failed"
                              for s in i.shards)]
    return min(candidates, key=lambda i: len(open_tasks.get(i.instance_id, ())), default=None)


def waiting_tasks(state: State, now: float, limits: HealLimits, lost: frozenset[NodeId] = frozenset()) -> list[Event]:
    """Tasks waiting for an instance: to one that can take them, or ended past the deadline (or
    when nothing will place one: no desire of their model)."""
    events: list[Event] = []
    for task in state.open_tasks_of(InstanceId("")):
        target = usable_instance(state, task.model_id, lost=lost)
        since = task.migrations[-1].at if task.migrations else task.created_at
        desire = next((d for d in state.desires.values() if d.model_id == task.model_id), None)
        if task.cancel_requested:
            events.append(TaskFinished(task_id=task.task_id, status="cancelled", finish_reason="cancelled",
                                       error="cancelled while waiting for an instance"))
        elif target is not None:
            events.append(TaskMigrated(task_id=task.task_id, to_instance=target.instance_id,
                                       reason="an instance of its model is ready", at=now))
        elif desire is None or now - since >= (limits.deadline_s if task.migrations else limits.load_timeout_s):
            events.append(TaskFinished(task_id=task.task_id, status="failed", finish_reason="error",
                                       error=_why_waited_out(task, desire, now - since, limits)))
    return events


def _why_waited_out(task: Task, desire: Desire | None, waited: float, limits: HealLimits) -> str:
    why = f"waited {waited:.0f} s" if desire is not None else "no placement of its model is kept"
    waiting = f": {desire.waiting}" if desire is not None and desire.waiting else ""
    if task.migrations:
        return f"its instance died and no instance of {task.model_id!r} took it over ({why}{waiting})"
    bound = ", the most EXO_LOAD_TIMEOUT_S allows" if desire is not None else ""
    return f"no instance of {task.model_id!r} was ready for it ({why}{bound}{waiting})"


def replace_missing(state: State, builtin: Mapping[ModelId, ModelCard], ids: Iterator[str], now: float,
                    avoid: frozenset[NodeId] = frozenset()) -> list[Event]:
    """One new instance per desire short of its replicas (past its back-off), on nodes not in
    `avoid` (suspect ones), apart from its other instances where memory allows; or why it waits."""
    events: list[Event] = []
    for desire in sorted(state.desires.values(), key=lambda d: d.desire_id):
        current = state.instances_of_desire(desire.desire_id)
        if len(current) >= desire.replicas:
            if desire.waiting or (desire.failures and _all_ready(state, current)):
                events.append(DesireSet(desire=replace(desire, waiting="", failures=0 if _all_ready(state, current)
                                                       else desire.failures)))
            continue
        if now < desire.retry_at:
            continue
        placed = place_for(state, desire, builtin, ids, avoid, frozenset(s.node_id for i in current for s in i.shards))
        if isinstance(placed, Instance):
            events.append(InstanceCreated(command_id=CommandId(desire.desire_id), instance=placed))
        elif placed.reason != desire.waiting:
            events.append(DesireSet(desire=replace(desire, waiting=placed.reason)))
    return events


def place_for(state: State, desire: Desire, builtin: Mapping[ModelId, ModelCard], ids: Iterator[str],
              avoid: frozenset[NodeId], siblings: frozenset[NodeId] = frozenset()) -> Instance | Unplaceable:
    """An instance of the desire, on nodes its siblings do not use if that fits, else anywhere but `avoid`."""
    card = find_card(state, builtin, desire.model_id)
    if card is None:
        return Unplaceable("not_found", f"its model card {desire.model_id!r} is gone")
    if (adapter := adapter_of(state, desire.model_id)) is not None and card.storage_bytes:
        card = replace(card, storage_bytes=card.storage_bytes + adapter.size)  # its weights sit beside the model's
    if desire.draft_model:
        with_draft = _with_draft(card, desire, state, builtin)
        if isinstance(with_draft, Unplaceable):
            return with_draft
        card = with_draft
    placed: Instance | Unplaceable = Unplaceable("unavailable", "")
    for exclude in ([avoid | siblings, avoid] if siblings - avoid else [avoid]):
        placed = place_instance(card, desire.sharding, desire.min_nodes, state, ids, desire.max_context,
                                desire.kv_bits, force=desire.force, exclude=exclude)
        if isinstance(placed, Instance) and desire.draft_model and len(placed.shards) > 1:
            placed = Unplaceable("conflict", f"{desire.model_id} and its draft {desire.draft_model} do not fit on one "
                                             "node: an instance with a draft model runs on one node")
        if isinstance(placed, Instance) and desire.role != "both" and len(placed.shards) > 1:
            placed = Unplaceable("conflict", f"{desire.model_id} does not fit on one node: a {desire.role} instance "
                                             "runs on one node")
        if isinstance(placed, Instance):
            return replace(placed, model_id=desire.model_id, max_queue=desire.max_queue, command_id=CommandId(desire.desire_id),
                           desire_id=desire.desire_id, draft_model=desire.draft_model,
                           num_draft_tokens=desire.num_draft_tokens, role=desire.role)
    return placed


def _with_draft(card: ModelCard, desire: Desire, state: State,
                builtin: Mapping[ModelId, ModelCard]) -> ModelCard | Unplaceable:
    """The card placement sizes: the model's, with its draft's weights on the same node."""
    draft = find_card(state, builtin, desire.draft_model)
    if draft is None:
        return Unplaceable("not_found", f"its draft model card {desire.draft_model!r} is gone")
    if desire.min_nodes > 1:
        return Unplaceable("conflict", "an instance with a draft model runs on one node: min_nodes must be 1")
    if draft.embedding is not None or draft.supports_images or card.embedding is not None or card.supports_images:
        return Unplaceable("conflict", "speculative decoding serves text models: neither the model nor its draft may "
                                       "be an embedding or vision model")
    return replace(card, storage_bytes=card.storage_bytes + draft.storage_bytes)


def _all_ready(state: State, instances: list[Instance]) -> bool:
    return all((r := state.runners.get(s.runner_id)) is not None and r.status == "ready"
               for i in instances for s in i.shards)


def after_failure(state: State, instance_id: InstanceId, now: float, limits: HealLimits) -> list[Event]:
    """An instance ended for failing: its desire waits longer before the next replacement."""
    desire = state.desires.get(state.instances[instance_id].desire_id)
    if desire is None:
        return []
    failures = desire.failures + 1
    return [DesireSet(desire=replace(desire, failures=failures, retry_at=now + backoff_s(failures, limits)))]


def deleted_by(events: list[Event]) -> frozenset[InstanceId]:
    return frozenset(e.instance_id for e in events if isinstance(e, InstanceDeleted))
