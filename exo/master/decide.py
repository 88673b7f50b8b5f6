"""The master's decisions: command x State -> events. Pure: time and ids come in as arguments."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Set

from msgspec.structs import replace

from exo.core.adapter_use import being_deleted
from exo.core.catalogue import find_card
from exo.core.commands import (
    AddAdapter,
    AddCustomCard,
    AnyCommand,
    CancelTask,
    CreateJoinToken,
    DeleteAdapter,
    DeleteCustomCard,
    DeleteDesire,
    DeleteInstance,
    DeleteKey,
    GenerateText,
    PlaceInstance,
    RedeemJoinToken,
    RemoveNode,
    SetKey,
    command_tag,
    replica_bounds_problem,
)
from exo.core.events import (
    CommandRejected,
    CustomCardAdded,
    CustomCardDeleted,
    DesireEnded,
    DesireSet,
    Event,
    InstanceCreated,
    InstanceDeleted,
    KeyDeleted,
    KeySet,
    TaskCancelRequested,
    TaskFinished,
)
from exo.core.ids import InstanceId, ModelId, TaskId
from exo.core.keys import KeyWindow, Reserved, admission, cache_scope_of
from exo.core.node_names import node_display
from exo.core.placement import Unplaceable
from exo.core.requests import GenerationParams, rows_of
from exo.core.reservations import reserved_tokens
from exo.core.state import State
from exo.core.types import Desire, Instance, ModelCard, RejectionCode, Task
from exo.core.usage import day_of, tokens_in_day, tokens_in_month
from exo.master.adapters import add_adapter, delete_adapter
from exo.master.disaggregation import decode_fallback_note, decoders, prefill_instance_for
from exo.master.eviction import place_making_room
from exo.master.heal import HealLimits, place_for
from exo.master.join_tokens import create_join_token, redeem_join_token
from exo.master.memo import DecideMemo
from exo.master.on_demand import kept_alive, task_created, without_instance
from exo.master.removal import remove_node
from exo.master.routing import NO_REPORTS, base_serving, choose_sharing
from exo.settings.services import MasterSettings

MAX_REPLICAS = 64
DEFAULT_DRAFT_TOKENS = 3  # mlx_lm.server's --num-draft-tokens
MAX_DRAFT_TOKENS = 16

# Open (pending or running) tasks an instance admits, unless placed with its own max_queue.
DEFAULT_MAX_QUEUE = MasterSettings().max_queue  # EXO_MAX_QUEUE's default
# A request for a model with no instance places one (EXO_ON_DEMAND's default).
DEFAULT_ON_DEMAND = MasterSettings().on_demand
DEFAULT_ADAPTERS_SHARE_BASE = MasterSettings().adapters_share_base  # an adapter served by its base's instance
DEFAULT_KEEP_ALIVE_S = MasterSettings().keep_alive_s  # how long a model placed on demand stays loaded, idle


def decide(
    state: State,
    command: AnyCommand,
    *,
    builtin_cards: Mapping[ModelId, ModelCard],
    ids: Iterator[str],
    default_max_queue: int = DEFAULT_MAX_QUEUE,
    cache_routing: bool = True,
    memo: DecideMemo | None = None,
    on_demand: bool = DEFAULT_ON_DEMAND,
    keep_alive_s: float = DEFAULT_KEEP_ALIVE_S,
    cache_dropped: Mapping[InstanceId, Set[TaskId]] = NO_REPORTS,
    adapters_share_base: bool = DEFAULT_ADAPTERS_SHARE_BASE,
    heal: HealLimits = HealLimits(),
) -> list[Event]:
    """`cache_dropped`: what runners report their prompt caches no longer hold (routing.py); the
    one input that is not State: a soft hint, so a redecided command may route elsewhere."""
    if command.command_id in state.answered_commands:
        return []  # redelivered after its first master appended the answer: decided already
    match command:
        case PlaceInstance():
            return _place(state, command, builtin_cards, ids)
        case DeleteInstance():
            return _delete_instance(state, command)
        case DeleteDesire():
            return _delete_desire(state, command)
        case GenerateText():
            events = _generate(state, command, builtin_cards, ids, default_max_queue, cache_routing, memo or DecideMemo(),
                               on_demand, keep_alive_s, cache_dropped, adapters_share_base)
            return kept_alive(state, command, events)
        case CancelTask():
            return _cancel(state, command)
        case AddCustomCard():
            return _add_card(state, command, builtin_cards)
        case DeleteCustomCard():
            return _delete_card(state, command, builtin_cards)
        case AddAdapter():
            return add_adapter(state, command, builtin_cards)
        case DeleteAdapter():
            return delete_adapter(state, command)
        case SetKey():
            return _set_key(state, command)
        case DeleteKey():
            return _delete_key(state, command)
        case RemoveNode():
            return remove_node(state, command, heal)
        case CreateJoinToken():
            return create_join_token(state, command)
        case RedeemJoinToken():
            return redeem_join_token(state, command)


def _reject(command: AnyCommand, code: RejectionCode, reason: str, retry_after_s: float = 0.0) -> list[Event]:
    return [CommandRejected(command_id=command.command_id, command_kind=command_tag(command), code=code, reason=reason,
                            retry_after_s=retry_after_s)]


def _place(state: State, command: PlaceInstance, builtin: Mapping[ModelId, ModelCard], ids: Iterator[str]) -> list[Event]:
    """A desire (kept placed by exo/master/heal.py) and its first instances, on distinct nodes where memory allows."""
    if not 1 <= command.replicas <= MAX_REPLICAS:
        return _reject(command, "invalid", f"replicas must be between 1 and {MAX_REPLICAS}, not {command.replicas}")
    if problem := replica_bounds_problem(command.min_replicas, command.replicas, command.max_replicas, MAX_REPLICAS):
        return _reject(command, "invalid", problem[1])
    if command.role != "both" and command.min_nodes != 1:
        return _reject(command, "invalid", f"a {command.role} instance runs on one node: min_nodes must be 1")
    card = find_card(state, builtin, command.model_id)
    if card is None:
        return _reject(command, "not_found", f"unknown model {command.model_id!r}")
    if deleting := being_deleted(state, command.model_id):
        return _reject(command, "not_found", deleting)
    if not 0 <= command.num_draft_tokens <= MAX_DRAFT_TOKENS:
        return _reject(command, "invalid", f"num_draft_tokens must be between 1 and {MAX_DRAFT_TOKENS} (0: "
                                           f"{DEFAULT_DRAFT_TOKENS}), not {command.num_draft_tokens}")
    if command.draft_model and find_card(state, builtin, command.draft_model) is None:
        return _reject(command, "not_found", f"unknown draft model {command.draft_model!r}")
    desire = Desire(desire_id=command.command_id, model_id=command.model_id, sharding=command.sharding,
                    min_nodes=command.min_nodes, max_queue=command.max_queue, max_context=command.max_context,
                    kv_bits=command.kv_bits, force=command.force, replicas=command.replicas,
                    draft_model=command.draft_model,
                    num_draft_tokens=command.num_draft_tokens or (DEFAULT_DRAFT_TOKENS if command.draft_model else 0),
                    keep_alive_s=command.keep_alive_s, last_used_at=command.at, role=command.role,
                    min_replicas=command.replica_bounds()[0], max_replicas=command.replica_bounds()[1])
    room = place_making_room(state, desire, builtin, ids)
    if isinstance(room, Unplaceable):
        return _reject(command, room.code, room.reason)
    placed, state = room.instance, room.state
    # The evictions name no command: its caller's answer is the first event naming it, the instance.
    events: list[Event] = [*room.events, InstanceCreated(command_id=command.command_id, instance=placed,
                                                         evicted=room.evictions),
                           DesireSet(command_id=command.command_id, desire=desire)]
    used = {s.node_id for s in placed.shards}
    for _ in range(command.replicas - 1):  # the rest, each counting the memory the ones before it take
        planned = _with_instance(state, placed)
        placed_next = place_for(planned, desire, builtin, ids, frozenset(), frozenset(used))
        if isinstance(placed_next, Unplaceable):
            events.append(DesireSet(desire=replace(desire, waiting=placed_next.reason)))
            break
        placed, state = placed_next, planned
        used |= {s.node_id for s in placed.shards}
        events.append(InstanceCreated(command_id=command.command_id, instance=placed))
    return events


def _with_instance(state: State, instance: Instance) -> State:
    """State as placement sees it once `instance` is in it (its memory reserved)."""
    return replace(state, instances={**state.instances, instance.instance_id: instance})


def _delete_instance(state: State, command: DeleteInstance) -> list[Event]:
    instance = state.instances.get(command.instance_id)
    if instance is None:
        return _reject(command, "not_found", f"unknown instance {command.instance_id!r}")
    # Open tasks end with the instance, so no caller waits for an answer that cannot come.
    ended: list[Event] = [
        TaskFinished(task_id=t.task_id, status="cancelled", finish_reason="cancelled", error="instance deleted")
        for t in state.open_tasks_of(command.instance_id)
    ]
    deleted = InstanceDeleted(command_id=command.command_id, instance_id=command.instance_id, reason="deleted on request")
    return [*ended, *_fewer_replicas(state, instance, command), deleted]


def _fewer_replicas(state: State, instance: Instance, command: DeleteInstance) -> list[Event]:
    """Deleting an instance asks for one fewer: its desire ends with its last one."""
    desire = state.desires.get(instance.desire_id)
    if desire is None:
        return []
    if desire.replicas <= 1 or len(state.instances_of_desire(desire.desire_id)) <= 1:
        return [DesireEnded(command_id=command.command_id, desire_id=desire.desire_id, reason="its last instance was deleted")]
    fewer = desire.replicas - 1  # a person asked for fewer: the autoscaler's floor follows
    floor = None if desire.min_replicas is None else min(desire.min_replicas, fewer)
    return [DesireSet(command_id=command.command_id, desire=replace(desire, replicas=fewer, min_replicas=floor))]


def _delete_desire(state: State, command: DeleteDesire) -> list[Event]:
    if command.desire_id not in state.desires:
        return _reject(command, "not_found", f"unknown desire {command.desire_id!r}")
    events: list[Event] = []
    for instance in state.instances_of_desire(command.desire_id):
        events += [TaskFinished(task_id=t.task_id, status="cancelled", finish_reason="cancelled", error="instance deleted")
                   for t in state.open_tasks_of(instance.instance_id)]
        events.append(InstanceDeleted(command_id=command.command_id, instance_id=instance.instance_id,
                                      reason="its desire was deleted"))
    return [*events, DesireEnded(command_id=command.command_id, desire_id=command.desire_id, reason="deleted on request")]


def _generate(state: State, command: GenerateText, builtin: Mapping[ModelId, ModelCard], ids: Iterator[str],
              default_max_queue: int, cache_routing: bool, memo: DecideMemo, on_demand: bool,
              keep_alive_s: float, cache_dropped: Mapping[InstanceId, Set[TaskId]] = NO_REPORTS,
              adapters_share_base: bool = DEFAULT_ADAPTERS_SHARE_BASE) -> list[Event]:
    if find_card(state, builtin, command.model_id) is None:
        return _reject(command, "not_found", f"unknown model {command.model_id!r}")
    if deleting := being_deleted(state, command.model_id):  # those it runs end first: none may join them
        return _reject(command, "not_found", deleting)
    if command.key_id and (refused := _over_limits(state, command, builtin)):
        return refused
    instances, failures = memo.serving.of(state, command.model_id)
    if not instances and adapters_share_base:
        instances, failures = base_serving(state, command.model_id, memo.serving)
    # Cache and routing partitioned by the key's scope, from State: a command cannot choose another's.
    params = replace(command.params, cache_scope=cache_scope_of(state.api_keys.get(command.key_id)))
    if not instances:
        return without_instance(state, command, builtin, ids, params, on_demand, keep_alive_s)
    # A failed instance serves nothing until its runner restarts (the worker retries with back-off):
    # say so now, as a 503 with the reason, rather than queue the request for a failure.
    if len(failures) == len(instances):
        runner = failures[instances[0].instance_id]
        return _reject(command, "unavailable", f"instance {runner.instance_id} of {command.model_id!r} failed on "
                                               f"{node_display(state, runner.node_id)}: "
                                               f"{runner.error or 'the runner failed'}; it may be restarted "
                                               f"with back-off (GET /instance/{runner.instance_id} shows how it is "
                                               "doing), or delete it and place it again")
    instances = [i for i in instances if i.instance_id not in failures]
    # Admission: an instance with room in its queue for the request's rows (the one holding the
    # conversation's prompt cache, else the least busy: routing.py); none with room: try later.
    open_rows, rows = _open_rows(state, instances), rows_of(params)
    with_room = [i for i in instances if open_rows[i.instance_id] + rows <= (i.max_queue or default_max_queue)]
    if not with_room:
        return _full_queues(command, instances, rows, default_max_queue)
    chosen, cached = choose_sharing(state, decoders(with_room), params, open_rows, by_conversation=cache_routing,
                                    index=memo.tasks, dropped=cache_dropped, model_id=command.model_id)
    # A decode instance that holds the conversation's earlier turns prefills only the new ones itself.
    prefill = "" if cached else prefill_instance_for(state, chosen, instances, params, command.model_id, open_rows)
    return [task_created(command, params, chosen.instance_id, prefill, decode_fallback_note(chosen, instances))]


def _open_rows(state: State, instances: list[Instance]) -> dict[InstanceId, int]:
    """The batch rows each instance's open tasks decode: a task of n choices counts n."""
    open_by_instance = state.open_tasks_by_instance()
    return {i.instance_id: sum(rows_of(t.params) for t in open_by_instance.get(i.instance_id, ())) for i in instances}


def _full_queues(command: GenerateText, instances: list[Instance], rows: int, default_max_queue: int) -> list[Event]:
    longest = max(i.max_queue or default_max_queue for i in instances)
    if rows > longest:  # it can never fit: a 400 that says why, not a 429 to retry for ever
        return _reject(command, "invalid", f"this request's {rows} choices (n or best_of) count as {rows} requests, "
                                           f"more than the {longest} open requests an instance of "
                                           f"{command.model_id!r} admits: send a smaller n")
    return _reject(command, "overloaded",
                   f"every instance of {command.model_id!r} has a full queue; try again shortly")


def _cancel(state: State, command: CancelTask) -> list[Event]:
    task = state.tasks.get(command.task_id)
    if task is None:
        return _reject(command, "not_found", f"unknown task {command.task_id!r}")
    if task.status not in ("pending", "running") or task.cancel_requested:
        return []  # already ending: cancelling twice is not an error
    return [TaskCancelRequested(command_id=command.command_id, task_id=command.task_id)]


def _add_card(state: State, command: AddCustomCard, builtin: Mapping[ModelId, ModelCard]) -> list[Event]:
    model_id = command.card.model_id
    problem = command.card.problem()
    if problem:
        return _reject(command, "invalid", problem)
    if model_id in builtin:
        return _reject(command, "conflict", f"{model_id!r} is a built-in model card")
    return [CustomCardAdded(command_id=command.command_id, card=command.card)]


def _delete_card(state: State, command: DeleteCustomCard, builtin: Mapping[ModelId, ModelCard]) -> list[Event]:
    if command.model_id in builtin:
        return _reject(command, "conflict", f"{command.model_id!r} is a built-in model card and cannot be deleted")
    if command.model_id not in state.custom_model_cards:
        return _reject(command, "not_found", f"unknown custom model {command.model_id!r}")
    if state.instances_of(command.model_id):
        return _reject(command, "conflict", f"{command.model_id!r} has running instances; delete them first")
    fitted = sorted(a.name for a in state.adapters.values() if a.base_model == command.model_id)
    if fitted:
        return _reject(command, "conflict", f"adapters fit {command.model_id!r} ({', '.join(fitted)}); delete them first")
    return [CustomCardDeleted(command_id=command.command_id, model_id=command.model_id)]


def _over_limits(state: State, command: GenerateText, builtin: Mapping[ModelId, ModelCard]) -> list[Event]:
    """Admission within the key's limits (exo/core/keys.py): here, where every request is decided
    in order, so API nodes together never let a key past its limit."""
    key = state.api_keys.get(command.key_id)
    if key is None:
        return _reject(command, "unauthorized", f"API key {command.key_id} was deleted")
    if not key.may_use(command.model_id):
        return _reject(command, "unauthorized", f"API key {key.key_id} may not use {command.model_id!r}")
    limits = key.limits
    counts_tokens = limits.tokens_per_minute or limits.tokens_per_day or limits.tokens_per_month
    refusal = admission(key, state.key_windows.get(key.key_id, KeyWindow()), state.open_rows_of_key(key.key_id),
                        tokens_in_day(state.usage, key.key_id, command.at),
                        tokens_in_month(state.usage, key.key_id, command.at), command.at,
                        _reserved(state, command, builtin) if counts_tokens else Reserved(), rows_of(command.params))
    return [] if refusal is None else _reject(command, "rate_limited", refusal.reason, refusal.retry_after_s)


def _reserved(state: State, command: GenerateText, builtin: Mapping[ModelId, ModelCard]) -> Reserved:
    """The tokens the key's open requests reserve in the minute, day and month of `command.at`,
    and the request's own (exo/core/reservations.py)."""
    contexts: dict[ModelId, int] = {}

    def reserve(params: GenerationParams, model_id: ModelId) -> int:
        if model_id not in contexts:
            contexts[model_id] = _context_of(state, builtin, model_id)
        return reserved_tokens(params, contexts[model_id])

    minute, day = int(command.at // 60), day_of(command.at)
    held = [0, 0, 0]
    for task in state.tasks.values():
        if task.key_id == command.key_id and task.status in ("pending", "running"):
            tokens, task_day = reserve(task.params, task.model_id), day_of(task.created_at)
            held[0] += tokens if int(task.created_at // 60) == minute else 0
            held[1] += tokens if task_day == day else 0
            held[2] += tokens if task_day[:7] == day[:7] else 0
    return Reserved(asked=reserve(command.params, command.model_id), minute=held[0], day=held[1], month=held[2])


def _context_of(state: State, builtin: Mapping[ModelId, ModelCard], model_id: ModelId) -> int:
    """The most context (prompt + answer) an instance of the model has room for; 0: unknown."""
    card = find_card(state, builtin, model_id)
    whole = card.context_length if card is not None else 0
    return max((i.max_context or whole for i in state.instances.values() if i.model_id == model_id), default=whole)


def _set_key(state: State, command: SetKey) -> list[Event]:
    if problem := command.key.problem():
        return _reject(command, "invalid", problem)
    known = state.api_keys.get(command.key.key_id)
    if command.new and known is not None:
        return _reject(command, "conflict", f"API key {command.key.key_id} exists already")
    if not command.new and known is None:
        return _reject(command, "not_found", f"unknown API key {command.key.key_id!r}")
    if not command.new and known is not None and known.secret_sha256 != command.key.secret_sha256:
        return _reject(command, "invalid", "a key's secret cannot be changed: delete it and add another")
    return [KeySet(command_id=command.command_id, key=command.key)]


def _delete_key(state: State, command: DeleteKey) -> list[Event]:
    if command.key_id not in state.api_keys:
        return _reject(command, "not_found", f"unknown API key {command.key_id!r}")
    ended = deleted_keys_tasks_ended(t for t in state.tasks.values() if t.key_id == command.key_id)
    return [*ended, KeyDeleted(command_id=command.command_id, key_id=command.key_id)]


KEY_DELETED = "the API key was deleted"


def deleted_keys_tasks_ended(tasks: Iterable[Task]) -> list[Event]:
    """The open ones of a deleted key's tasks end: one its runner has, or may have, is asked to
    cancel (its runner stops and reports the tokens it used, which are counted); one waiting for an
    instance ends now."""
    events: list[Event] = []
    for task in tasks:
        if task.status not in ("pending", "running") or task.cancel_requested:
            continue
        if task.instance_id:
            events.append(TaskCancelRequested(task_id=task.task_id, reason=KEY_DELETED))
        else:
            events.append(TaskFinished(task_id=task.task_id, status="cancelled", finish_reason="cancelled",
                                       error=KEY_DELETED))
    return events
