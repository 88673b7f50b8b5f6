"""Idle unload (exo/master/supervise.py idle_desires): a desire idle for its keep_alive ends with its
instances; a task open or waiting keeps it; idleness counts from its latest task's creation or end
(stamped by the reducer, exo/core/apply_tasks.py). Pure: `now` is passed in."""

from __future__ import annotations

import itertools

from exo.core.commands import GenerateText, PlaceInstance
from exo.core.events import (
    DesireEnded,
    DesireSet,
    InstanceDeleted,
    NodeRegistered,
    RunnerStatusChanged,
    TaskCreated,
    TaskFinished,
)
from exo.core.state import State
from exo.core.types import Desire, ModelCard, NodeInfo, Task
from exo.master.decide import decide
from exo.master.supervise import idle_desires
from tests.support.as_master import fold

MODEL = "org/m"
CARDS = {MODEL: ModelCard(model_id=MODEL, n_layers=4, storage_bytes=1000)}


def ask(state: State, command_id: str, at: float, keep_alive_s: float | None = None) -> State:
    command = GenerateText(command_id=command_id, model_id=MODEL, at=at, keep_alive_s=keep_alive_s)
    events = decide(state, command, builtin_cards=CARDS, ids=(f"{command_id}-{n}" for n in itertools.count()),
                    keep_alive_s=60.0)
    return fold(events, state)


def ready(state: State, at: float, runner_id: str = "g1-1", instance_id: str = "g1-2") -> State:
    return fold([RunnerStatusChanged(runner_id=runner_id, instance_id=instance_id, node_id="n1", status="ready", at=at)],
                state)


def placed_on_demand(keep_alive_s: float | None = None) -> State:
    """A request at t=100 placed the model on demand (its desire g1-0, runner g1-1, instance g1-2),
    loaded at once; its task is open."""
    state = ask(fold([NodeRegistered(node=NodeInfo(node_id="n1", memory_available=10_000))]), "g1", 100.0, keep_alive_s)
    return ready(state, at=100.0)


def unloaded(reason: str) -> list:
    return [InstanceDeleted(instance_id="g1-2", reason=reason), DesireEnded(desire_id="g1-0", reason=reason)]


def test_an_idle_desire_placed_on_demand_unloads_after_its_keep_alive_counted_from_its_last_tasks_end():
    state = placed_on_demand()
    assert state.desires["g1-0"].keep_alive_s == 60.0 and state.desires["g1-0"].last_used_at == 100.0
    assert idle_desires(state, now=1000.0) == []  # its task is open: kept however long
    state = fold([TaskFinished(task_id="g1", status="completed", at=130.0)], state)
    assert state.desires["g1-0"].last_used_at == 130.0
    assert idle_desires(state, now=189.9) == []
    assert idle_desires(state, now=190.0) == unloaded("idle for 60 s (keep_alive 60 s)")


def test_keep_alive_zero_unloads_right_after_the_request_and_negative_never():
    state = fold([TaskFinished(task_id="g1", status="completed", at=130.0)], placed_on_demand(keep_alive_s=0))
    assert idle_desires(state, now=130.0) == unloaded("idle for 0 s (keep_alive 0 s)")
    pinned = fold([TaskFinished(task_id="g1", status="completed", at=130.0)], placed_on_demand(keep_alive_s=-1))
    assert idle_desires(pinned, now=1e9) == []


def test_a_requests_keep_alive_becomes_its_models_and_a_waiting_task_keeps_the_desire():
    state = fold([TaskFinished(task_id="g1", status="completed", at=130.0)], placed_on_demand())
    later = ask(state, "g2", 140.0, keep_alive_s=5.0)
    assert later.desires["g1-0"].keep_alive_s == 5.0 and later.desires["g1-0"].last_used_at == 140.0
    waiting = fold([DesireSet(desire=state.desires["g1-0"]), InstanceDeleted(instance_id="g1-2", reason="gone"),
                    TaskCreated(task=Task(task_id="w", instance_id="", model_id=MODEL))], state)
    assert idle_desires(waiting, now=1e9) == []


def test_a_desire_placed_explicitly_without_keep_alive_or_never_stamped_stays():
    state = fold([TaskFinished(task_id="g1", status="completed", at=130.0)], placed_on_demand())
    never_stamped = fold([DesireSet(desire=Desire(desire_id="g1-0", model_id=MODEL, keep_alive_s=5.0))], state)
    assert idle_desires(never_stamped, now=1e9) == []


def test_a_model_that_takes_long_to_load_is_not_idle_before_it_is_ready():
    # An explicit placement with a 2 s keep_alive, asked at t=100, whose model loads for 50 s: it
    # is not unloaded while loading, and its keep_alive counts from its readiness (the worker's clock).
    nodes = fold([NodeRegistered(node=NodeInfo(node_id="n1", memory_available=10_000))])
    place = PlaceInstance(command_id="p1", model_id=MODEL, keep_alive_s=2.0, at=100.0)
    state = fold(decide(nodes, place, builtin_cards=CARDS, ids=(f"p1-{n}" for n in itertools.count())), nodes)
    (instance,) = state.instances.values()
    assert idle_desires(state, now=140.0) == []  # loading: 40 s past its keep_alive, kept
    state = ready(state, at=150.0, runner_id=instance.shards[0].runner_id, instance_id=instance.instance_id)
    assert state.desires["p1"].last_used_at == 150.0
    assert idle_desires(state, now=151.0) == []
    reason = "idle for 3 s (keep_alive 2 s)"
    assert idle_desires(state, now=153.0) == [InstanceDeleted(instance_id=instance.instance_id, reason=reason),
                                              DesireEnded(desire_id="p1", reason=reason)]
