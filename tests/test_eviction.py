"""A placement that does not fit unloads idle desires with a keep_alive, least recently used first,
only as many as it takes; never a busy or pinned one (exo/master/eviction.py). Pure decisions."""

from __future__ import annotations

import itertools
import logging

import msgspec
import pytest

from exo.core.commands import GenerateText, PlaceInstance
from exo.core.events import (
    CommandRejected,
    DesireEnded,
    DesireSet,
    Event,
    Eviction,
    InstanceCreated,
    InstanceDeleted,
    TaskCreated,
)
from exo.core.ids import InstanceId, ModelId, RunnerId, TaskId
from exo.core.state import State
from exo.core.types import Desire, Instance, ModelCard, NodeInfo, RunnerInfo, Task
from exo.master.decide import decide
from exo.master.heal import place_for
from exo.master.lifecycle_log import LifecycleLog
from tests.support.as_master import fold, with_leader

GB = 1_000_000_000
A1, A2, B = ModelId("org/a1"), ModelId("org/a2"), ModelId("org/b")
EVICTED_FOR_B = f"evicted to make room for {B}"


def cards(a1: int = 4 * GB, a2: int = 4 * GB, b: int = 4 * GB) -> dict[ModelId, ModelCard]:
    return {m: ModelCard(model_id=m, n_layers=4, storage_bytes=size) for m, size in ((A1, a1), (A2, a2), (B, b))}


def ids_for(prefix: str):
    return (f"{prefix}-{n}" for n in itertools.count())


def loaded(state: State, model: ModelId, desire_id: str, used_at: float, builtin: dict[ModelId, ModelCard], *,
           keep_alive_s: float = 300.0, on_demand: bool = True) -> State:
    """State with the model's desire and its instance loaded: runners ready, their weights in the node's report."""
    desire = Desire(desire_id=desire_id, model_id=model, on_demand=on_demand, keep_alive_s=keep_alive_s,
                    last_used_at=used_at)
    instance = place_for(state, desire, builtin, ids_for(desire_id), frozenset())
    assert isinstance(instance, Instance), instance
    runners = {s.runner_id: RunnerInfo(runner_id=s.runner_id, instance_id=instance.instance_id, node_id=s.node_id,
                                       status="ready") for s in instance.shards}
    nodes = {n.node_id: msgspec.structs.replace(n, memory_available=n.memory_available - sum(
        s.memory_bytes for s in instance.shards if s.node_id == n.node_id)) for n in state.nodes.values()}
    return msgspec.structs.replace(state, nodes=nodes, instances={**state.instances, instance.instance_id: instance},
                                   runners={**state.runners, **runners}, desires={**state.desires, desire_id: desire})


def two_loaded(builtin: dict[ModelId, ModelCard], *, a1_keep_alive_s: float = 300.0, a1_on_demand: bool = True) -> State:
    """One 10 GB node holding A1 (used at t=10) and A2 (used later, at t=20), both idle."""
    state = with_leader(State(nodes={"n1": NodeInfo(node_id="n1", memory_available=10 * GB)}))
    state = loaded(state, A1, "a1", 10.0, builtin, keep_alive_s=a1_keep_alive_s, on_demand=a1_on_demand)
    return loaded(state, A2, "a2", 20.0, builtin)


def with_open_task(state: State, model: ModelId, instance_id: str) -> State:
    task = Task(task_id=TaskId("t"), instance_id=InstanceId(instance_id), model_id=model, status="running")
    return msgspec.structs.replace(state, tasks={**state.tasks, task.task_id: task})


def ask_for_b(state: State, builtin: dict[ModelId, ModelCard]) -> list[Event]:
    return decide(state, GenerateText(command_id="g", model_id=B, at=100.0), builtin_cards=builtin, ids=ids_for("g"))


def evicted(events: list[Event]) -> list[str]:
    return [e.desire_id for e in events if isinstance(e, DesireEnded)]


def test_b_asked_while_idle_a1_and_a2_fill_memory_unloads_only_a1_the_least_recently_used():
    builtin = cards()
    state = two_loaded(builtin)
    events = ask_for_b(state, builtin)
    placed = next(e for e in events if isinstance(e, InstanceCreated))
    assert events == [
        InstanceDeleted(instance_id=InstanceId("a1-1"), reason=EVICTED_FOR_B),
        DesireEnded(desire_id="a1", reason=EVICTED_FOR_B),
        InstanceCreated(command_id="g-0", instance=placed.instance,
                        evicted=[Eviction(desire_id="a1", model_id=A1, instance_ids=[InstanceId("a1-1")])]),
        DesireSet(command_id="g-0", desire=Desire(desire_id="g-0", model_id=B, on_demand=True, keep_alive_s=300.0,
                                                  last_used_at=100.0, min_replicas=0, max_replicas=1)),
        TaskCreated(command_id="g", task=Task(task_id=TaskId("g"), instance_id=placed.instance.instance_id,
                                              model_id=B, created_at=100.0)),
    ]
    assert [(s.node_id, s.memory_bytes) for s in placed.instance.shards] == [("n1", 4 * GB)]
    after = fold(events, state)
    assert sorted(after.desires) == ["a2", "g-0"] and sorted(after.instances) == ["a2-1", placed.instance.instance_id]


def test_a1_with_an_open_task_stays_and_a2_goes_instead():
    builtin = cards()
    assert evicted(ask_for_b(with_open_task(two_loaded(builtin), A1, "a1-1"), builtin)) == ["a2"]


def test_a_request_waiting_for_a1s_model_keeps_it_too():
    builtin = cards()
    assert evicted(ask_for_b(with_open_task(two_loaded(builtin), A1, ""), builtin)) == ["a2"]


@pytest.mark.parametrize(("keep_alive_s", "on_demand"), [(-1.0, False), (-1.0, True)],
                         ids=["placed-explicitly", "keep-alive-negative"])
def test_a_pinned_desire_is_never_evicted(keep_alive_s: float, on_demand: bool):
    builtin = cards()
    state = two_loaded(builtin, a1_keep_alive_s=keep_alive_s, a1_on_demand=on_demand)
    assert evicted(ask_for_b(state, builtin)) == ["a2"]


def test_only_as_many_as_needed_a_small_lru_one_that_would_not_make_room_stays():
    builtin = cards(a1=1 * GB, a2=4 * GB, b=8 * GB)  # 5 GB free; A2's 4 GB make room, A1's 1 GB alone does not
    assert evicted(ask_for_b(two_loaded(builtin), builtin)) == ["a2"]


def test_nothing_is_evicted_when_it_fits():
    builtin = cards(a1=2 * GB, a2=2 * GB)  # 6 GB free for B's 4
    events = ask_for_b(two_loaded(builtin), builtin)
    assert [type(e) for e in events] == [InstanceCreated, DesireSet, TaskCreated]
    assert events[0].evicted == []  # type: ignore[attr-defined]


def test_a_placement_that_cannot_fit_after_evicting_every_idle_one_names_what_would_have_to_go():
    builtin = cards(b=7 * GB)  # 2 GB free; A2 idle gives 6, A1 too would give 10
    state = with_open_task(two_loaded(builtin), A1, "a1-1")
    refused = decide(state, PlaceInstance(command_id="p", model_id=B), builtin_cards=builtin, ids=ids_for("p"))
    assert refused == [CommandRejected(
        command_id="p", command_kind="place_instance", code="conflict",
        reason=f"{B} needs 7.0 GB; the node with the most free memory (n1, 2.0 GB free) cannot hold it; it would fit "
               f"if {A2}, {A1} were unloaded, but {A1} is busy (1 open request(s))")]
    pinned = two_loaded(builtin, a1_keep_alive_s=-1.0, a1_on_demand=False)
    (on_demand,) = ask_for_b(pinned, builtin)
    assert isinstance(on_demand, CommandRejected) and on_demand.code == "conflict"
    assert on_demand.reason.endswith(f"it would fit if {A2}, {A1} were unloaded, but {A1} is pinned (placed explicitly)")


def test_a_model_too_big_for_the_empty_cluster_keeps_the_placements_own_reason():
    builtin = cards(b=20 * GB)
    refused = decide(two_loaded(builtin), PlaceInstance(command_id="p", model_id=B), builtin_cards=builtin,
                     ids=ids_for("p"))
    assert refused == [CommandRejected(command_id="p", command_kind="place_instance", code="conflict",
                                       reason=f"{B} needs 20.0 GB; the node with the most free memory (n1, 2.0 GB "
                                              "free) cannot hold it")]


def test_an_explicit_placement_evicts_too_and_its_answer_names_what_went(caplog: pytest.LogCaptureFixture):
    builtin = cards()
    state = two_loaded(builtin)
    events = decide(state, PlaceInstance(command_id="p", model_id=B, at=100.0), builtin_cards=builtin,
                    ids=ids_for("p"))
    answer = next(e for e in events if e.command_id == "p")  # type: ignore[attr-defined]  # the API's answer
    assert isinstance(answer, InstanceCreated)
    assert answer.evicted == [Eviction(desire_id="a1", model_id=A1, instance_ids=[InstanceId("a1-1")])]
    assert [type(e) for e in events] == [InstanceDeleted, DesireEnded, InstanceCreated, DesireSet]
    told = LifecycleLog(state, lambda: True)
    with caplog.at_level(logging.INFO, logger="exo.master.service"):
        for event in events:  # as the master's view folds them
            state = fold([event], state)
            told.on_event(state.last_seq, event, state)  # type: ignore[arg-type]  # every Event is an AnyEvent
    assert caplog.messages == [f"master: unloaded {A1} from n1: evicted to make room for {B} (instance a1-1)",
                               f"master: placed {B} on n1: by request (instance {answer.instance.instance_id})"]


def test_a_runner_still_loading_frees_nothing_more_than_its_instance_reserved():
    builtin = cards()
    state = two_loaded(builtin)
    # A1 still loading: the node's report does not hold its weights yet, placement counted them through it.
    loading = msgspec.structs.replace(state, runners={**state.runners, RunnerId("a1-0"): msgspec.structs.replace(
        state.runners[RunnerId("a1-0")], status="loading")}, nodes={"n1": NodeInfo(node_id="n1", memory_available=6 * GB)})
    assert evicted(ask_for_b(loading, builtin)) == ["a1"]
    # the node reports 6 GB free, less A1's 4 still to load: 2; unloading A1 gives back 4, not 8
    bigger = cards(b=7 * GB)
    assert isinstance(ask_for_b(msgspec.structs.replace(loading, desires={
        **loading.desires, "a2": msgspec.structs.replace(loading.desires["a2"], keep_alive_s=-1.0)}), bigger)[0],
        CommandRejected)
