"""The master's INFO lines for a model's lifecycle: placed on demand by a request, unloaded when idle or
evicted, scaled with its load."""

from __future__ import annotations

import logging

from exo.core.events import DesireEnded, DesireScaled, DesireSet, Event, InstanceCreated, InstanceDeleted
from exo.core.placement import node_label
from exo.core.state import State

log = logging.getLogger("exo.master.service")


def log_placed_on_demand(state: State, events: list[Event]) -> None:
    """One INFO line for each instance a request placed on demand: its model and nodes."""
    on_demand = {e.desire.desire_id for e in events if isinstance(e, DesireSet) and e.desire.on_demand}
    for event in events:
        if isinstance(event, InstanceCreated) and event.instance.desire_id in on_demand:
            nodes = ", ".join(node_label(state.nodes[s.node_id]) if s.node_id in state.nodes else s.node_id
                              for s in event.instance.shards)
            log.info("master: placed %s on demand on %s (instance %s)", event.instance.model_id, nodes,
                     event.instance.instance_id)


def log_evicted(state: State, events: list[Event]) -> None:
    """One INFO line per desire a placement unloaded to make room (its model, nodes and what for)."""
    for placed in (e for e in events if isinstance(e, InstanceCreated)):
        for eviction in placed.evicted:
            nodes = sorted({node_label(state.nodes[s.node_id]) if s.node_id in state.nodes else s.node_id
                            for i in eviction.instance_ids if i in state.instances
                            for s in state.instances[i].shards})
            log.info("master: unloaded %s from %s: evicted to make room for %s (instance %s)", eviction.model_id,
                     ", ".join(nodes) or "no node", placed.instance.model_id, ", ".join(eviction.instance_ids))


def log_unloaded(state: State, events: list[Event]) -> list[Event]:
    """One INFO line per desire the master ended for idleness (its model, nodes and why); returns
    the instance deletions that line tells of."""
    told: list[Event] = []
    for ended in (e for e in events if isinstance(e, DesireEnded) and e.desire_id in state.desires):
        deleted = [e for e in events if isinstance(e, InstanceDeleted) and e.reason == ended.reason
                   and (i := state.instances.get(e.instance_id)) is not None and i.desire_id == ended.desire_id]
        nodes = sorted({node_label(state.nodes[s.node_id]) if s.node_id in state.nodes else s.node_id
                        for e in deleted for s in state.instances[e.instance_id].shards})
        log.info("master: unloaded %s from %s: %s", state.desires[ended.desire_id].model_id,
                 ", ".join(nodes) or "no node", ended.reason)
        told += deleted
    return told + _log_scaled(state, events)


def _log_scaled(state: State, events: list[Event]) -> list[Event]:
    """One INFO line per scaling step (exo/master/autoscale.py); returns the instance a step down unloads."""
    told: list[Event] = []
    for scaled in (e for e in events if isinstance(e, DesireScaled) and e.desire_id in state.desires):
        unloaded = [e for e in events if isinstance(e, InstanceDeleted) and e.instance_id in state.instances
                    and state.instances[e.instance_id].desire_id == scaled.desire_id]
        log.info("master: scaled %s from %d to %d replica(s): %s%s", state.desires[scaled.desire_id].model_id,
                 scaled.from_replicas, scaled.to_replicas, scaled.reason,
                 "".join(f" (unloading instance {e.instance_id})" for e in unloaded))
        told += unloaded
    return told
