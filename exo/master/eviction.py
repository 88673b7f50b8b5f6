"""Room made for a placement that does not fit: idle desires with a keep_alive are unloaded, the
least recently used first, only as many as it takes (as Ollama and llama.cpp's router evict).

A desire with work (a task open on one of its instances, or waiting for its model) is busy; one
with a negative keep_alive (placed with POST /place_instance and no keep_alive, or asked to stay
forever) is pinned: neither is ever evicted. Each try places on a copy of State without the
candidates, their loaded weights counted free again on their nodes. Pure, as decide.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping

import msgspec
from msgspec.structs import replace

from exo.core.events import DesireEnded, Event, Eviction, InstanceDeleted
from exo.core.ids import InstanceId, ModelId, NodeId
from exo.core.placement import Unplaceable
from exo.core.placement_nodes import LOADED
from exo.core.state import State
from exo.core.types import Desire, Instance, ModelCard
from exo.master.heal import place_for


class Room(msgspec.Struct, frozen=True, kw_only=True):
    """A placement and what was unloaded for it."""

    instance: Instance
    evictions: list[Eviction]  # least recently used first
    events: list[Event]  # each evicted desire's InstanceDeleted and DesireEnded
    state: State  # State as the placement saw it: without the evicted instances, their memory free


def evicted_reason(model_id: ModelId) -> str:
    return f"evicted to make room for {model_id}"


def place_making_room(state: State, desire: Desire, builtin: Mapping[ModelId, ModelCard],
                      ids: Iterator[str]) -> Room | Unplaceable:
    """The desire's instance, placed after unloading the fewest idle desires it takes; or why not,
    naming the busy or pinned ones that would have to go when unloading every idle one is not enough."""
    placed = place_for(state, desire, builtin, ids, frozenset())
    if isinstance(placed, Instance):
        return Room(instance=placed, evictions=[], events=[], state=state)
    if placed.code != "conflict":  # no node, an unknown card, an invalid request: memory is not why
        return placed
    by_lru = sorted((d for d in state.desires.values() if state.instances_of_desire(d.desire_id)),
                    key=lambda d: (d.last_used_at, d.desire_id))
    idle = [d for d in by_lru if not why_kept(state, d)]
    chosen = _fewest(state, desire, idle, builtin)
    if chosen is None:
        return _what_would_have_to_go(state, desire, placed, idle + [d for d in by_lru if d not in idle], builtin)
    room = without(state, chosen)
    instance = place_for(room, desire, builtin, ids, frozenset())
    assert isinstance(instance, Instance)  # _fewest placed it on this very State
    reason = evicted_reason(desire.model_id)
    evictions = [Eviction(desire_id=d.desire_id, model_id=d.model_id,
                          instance_ids=[i.instance_id for i in state.instances_of_desire(d.desire_id)]) for d in chosen]
    events: list[Event] = []
    for eviction in evictions:
        events += [InstanceDeleted(instance_id=i, reason=reason) for i in eviction.instance_ids]
        events.append(DesireEnded(desire_id=eviction.desire_id, reason=reason))
    return Room(instance=instance, evictions=evictions, events=events, state=room)


def why_kept(state: State, desire: Desire) -> str:
    """Why the desire may not be evicted ("": it may)."""
    if desire.keep_alive_s < 0:
        return "pinned (placed explicitly)" if not desire.on_demand else "pinned (keep_alive negative)"
    by_instance = state.open_tasks_by_instance()
    open_tasks = sum(len(by_instance.get(i.instance_id, ())) for i in state.instances_of_desire(desire.desire_id))
    waiting = sum(1 for t in by_instance.get(InstanceId(""), ()) if t.model_id == desire.model_id)
    if open_tasks + waiting:
        return f"busy ({open_tasks + waiting} open request(s))"
    return ""


def _fewest(state: State, desire: Desire, candidates: list[Desire],
            builtin: Mapping[ModelId, ModelCard]) -> list[Desire] | None:
    """The shortest prefix of `candidates` whose unloading lets the desire fit, less any of it the
    placement turns out not to need (a small model on another node); None: not even all of them."""
    for n in range(1, len(candidates) + 1):
        if _fits(without(state, candidates[:n]), desire, builtin):
            chosen = candidates[:n]
            break
    else:
        return None
    for spared in reversed(chosen[:-1]):  # the most recently used of them first: keep it if it can stay
        fewer = [d for d in chosen if d is not spared]
        if _fits(without(state, fewer), desire, builtin):
            chosen = fewer
    return chosen


def _fits(state: State, desire: Desire, builtin: Mapping[ModelId, ModelCard]) -> bool:
    trial_ids = (f"trial-{n}" for n in itertools.count())  # a trial takes none of the decision's ids
    return isinstance(place_for(state, desire, builtin, trial_ids, frozenset()), Instance)


def _what_would_have_to_go(state: State, desire: Desire, refused: Unplaceable, candidates: list[Desire],
                           builtin: Mapping[ModelId, ModelCard]) -> Unplaceable:
    needed = _fewest(state, desire, candidates, builtin)
    blocked = [d for d in needed or [] if why_kept(state, d)]
    if not blocked:  # it does not fit even in an empty cluster: the placement's own reason says why
        return refused
    names = ", ".join(d.model_id for d in needed or [])
    kept = "; ".join(f"{d.model_id} is {why_kept(state, d)}" for d in blocked)
    return Unplaceable(refused.code, f"{refused.reason}; it would fit if {names} were unloaded, but {kept}")


def without(state: State, desires: list[Desire]) -> State:
    """State as placement sees it once these desires are unloaded: their instances and runners gone,
    and the weights their loaded runners hold free again in their nodes' reports."""
    gone = {i.instance_id: i for d in desires for i in state.instances_of_desire(d.desire_id)}
    freed: dict[NodeId, int] = {}
    for instance in gone.values():
        for shard in instance.shards:
            runner = state.runners.get(shard.runner_id)
            if runner is not None and runner.status in LOADED:  # else its weights counted through the instance, gone
                freed[shard.node_id] = freed.get(shard.node_id, 0) + shard.memory_bytes
    nodes = {node_id: replace(node, memory_available=node.memory_available + freed[node_id])
             if node.memory_available and node_id in freed else node  # 0: not reported, stays unconstrained
             for node_id, node in state.nodes.items()}
    ended = {d.desire_id for d in desires}
    return replace(state, nodes=nodes, instances={k: i for k, i in state.instances.items() if k not in gone},
                   runners={k: r for k, r in state.runners.items() if r.instance_id not in gone},
                   desires={k: d for k, d in state.desires.items() if k not in ended})
