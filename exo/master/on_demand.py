"""A request for a model with no instance: placed on demand (a desire of its own, by the usual
placement rules) and queued on it, and a request's keep_alive made its model's. Pure, as decide."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from msgspec.structs import replace

from exo.core.catalogue import find_card
from exo.core.commands import GenerateText, command_tag
from exo.core.events import CommandRejected, DesireSet, Event, InstanceCreated, TaskCreated
from exo.core.ids import CommandId, InstanceId, ModelId, TaskId
from exo.core.placement import Unplaceable
from exo.core.requests import GenerationParams
from exo.core.state import State
from exo.core.types import Desire, ModelCard, RejectionCode, Task
from exo.master.eviction import place_making_room


def _refuse(command: GenerateText, code: RejectionCode, reason: str) -> list[Event]:
    return [CommandRejected(command_id=command.command_id, command_kind=command_tag(command), code=code, reason=reason)]


def kept_alive(state: State, command: GenerateText, events: list[Event]) -> list[Event]:
    """A request's keep_alive becomes its model's desire's, as Ollama's latest request sets its model's."""
    created = next((e for e in events if isinstance(e, TaskCreated)), None)
    if command.keep_alive_s is None or created is None or any(isinstance(e, DesireSet) for e in events):
        return events
    instance = state.instances.get(created.task.instance_id)
    desire_id = instance.desire_id if instance is not None else next(
        (d.desire_id for d in state.desires.values() if d.model_id == command.model_id), "")
    desire = state.desires.get(desire_id)
    if desire is None or desire.keep_alive_s == command.keep_alive_s:
        return events
    return [DesireSet(desire=replace(desire, keep_alive_s=command.keep_alive_s)), *events]


def task_created(command: GenerateText, params: GenerationParams, instance_id: InstanceId,
                 prefill_instance: str = "", split_note: str = "") -> TaskCreated:
    task = Task(
        task_id=TaskId(command.command_id),  # a task is named after the command that asked for it
        instance_id=instance_id,  # "": it waits for an instance of its model (exo/master/heal.py)
        model_id=command.model_id,
        params=params,
        created_at=command.at,
        key_id=command.key_id,
        priority=command.priority,
        prefill_instance=InstanceId(prefill_instance),
        split_note=split_note,
    )
    return TaskCreated(command_id=command.command_id, task=task)


def without_instance(state: State, command: GenerateText, builtin: Mapping[ModelId, ModelCard], ids: Iterator[str],
                      params: GenerationParams, on_demand: bool, keep_alive_s: float) -> list[Event]:
    """No instance of the model: where the cluster and its card allow, one is placed on demand and
    the task queues on it (a worker gives it to the runner once loaded), or the task waits for the
    instance of the on-demand desire already placing one; else a 503 with why."""
    card = find_card(state, builtin, command.model_id)
    # A master group's log holds requests only: placements are the shared master's.
    allowed = on_demand and card is not None and card.on_demand and not state.group
    desire = next((d for d in state.desires.values() if d.model_id == command.model_id), None)
    if allowed and desire is None:
        return _place_on_demand(state, command, builtin, ids, params, keep_alive_s)
    # A placement scaled to no replica waits too: the autoscaler brings one back for the request.
    scaled_to_none = desire is not None and desire.replicas == 0 and not state.group
    if (allowed and desire is not None and desire.on_demand) or scaled_to_none:
        return [task_created(command, params, InstanceId(""))]
    ended = state.instance_end_reasons.get(command.model_id)
    why = f" (its last instance was deleted: {ended})" if ended else ""
    if desire is not None:  # exo/master/heal.py is placing one
        return _refuse(command, "unavailable", f"no instance of {command.model_id!r} is running{why}; its "
                                               f"placement {desire.desire_id} is waiting for one: "
                                               f"{desire.waiting or 'a replacement is being placed'}")
    card_says = " (its card says on_demand = false)" if on_demand and card is not None and not card.on_demand else ""
    return _refuse(command, "unavailable", f"no instance of {command.model_id!r} is running{why}; place one first"
                                           f"{card_says}")


def _place_on_demand(state: State, command: GenerateText, builtin: Mapping[ModelId, ModelCard], ids: Iterator[str],
                     params: GenerationParams, keep_alive_s: float) -> list[Event]:
    """A desire placed on demand, its instance (by the usual rules) and the task queued on it; it
    stays loaded for the request's keep_alive, else EXO_KEEP_ALIVE, without requests."""
    keep_alive = keep_alive_s if command.keep_alive_s is None else command.keep_alive_s
    # min 0: its keep_alive unloads it whole; max 1: more replicas are for a placement that asks for them.
    # A negative keep_alive keeps it until deleted: the autoscaler may not take its replica either.
    desire = Desire(desire_id=next(ids), model_id=command.model_id, on_demand=True, keep_alive_s=keep_alive,
                    last_used_at=command.at, min_replicas=0 if keep_alive >= 0 else 1, max_replicas=1)
    room = place_making_room(state, desire, builtin, ids)
    if isinstance(room, Unplaceable):
        return _refuse(command, room.code, f"no instance of {command.model_id!r} is running and none can be placed "
                                           f"on demand: {room.reason}")
    placed_by = CommandId(desire.desire_id)
    return [*room.events, InstanceCreated(command_id=placed_by, instance=room.instance, evicted=room.evictions),
            DesireSet(command_id=placed_by, desire=desire), task_created(command, params, room.instance.instance_id)]
