"""The master's decisions on plain data."""

import itertools

from exo.core.apply import apply
from exo.core.commands import AddCustomCard, CancelTask, DeleteCustomCard, DeleteInstance, GenerateText, PlaceInstance
from exo.core.events import (
    CommandRejected,
    CustomCardAdded,
    CustomCardDeleted,
    DesireEnded,
    DesireSet,
    InstanceCreated,
    InstanceDeleted,
    NodeRegistered,
    TaskCancelRequested,
    TaskCreated,
    TaskFinished,
)
from exo.core.requests import GenerationParams
from exo.core.state import State
from exo.core.types import ModelCard, NodeInfo
from exo.master.decide import decide
from exo.master.memo import DecideMemo
from tests.support.as_master import stamped, with_leader

BUILTIN = {"org/builtin": ModelCard(model_id="org/builtin", n_layers=8, storage_bytes=1000)}


def ids_for(command_id: str):
    return (f"{command_id}-{n}" for n in itertools.count())


# One memo for every decision of these tests (and test_routing's), as the master keeps one for all
# of its: each decision is made with it and without, and must be the same.
MEMO = DecideMemo()


def run(state: State, command) -> tuple[State, list]:
    events = decide(state, command, builtin_cards=BUILTIN, ids=ids_for(command.command_id))
    assert decide(state, command, builtin_cards=BUILTIN, ids=ids_for(command.command_id), memo=MEMO) == events
    for event in events:
        state = apply(state, stamped(state, event), state.last_seq + 1)
    return state, events


def with_node(memory: int = 10_000) -> State:
    return apply(with_leader(), NodeRegistered(node=NodeInfo(node_id="n1", memory_available=memory)), 1)


def rejection(events) -> tuple[str, str]:
    assert len(events) == 1 and isinstance(events[0], CommandRejected)
    return events[0].code, events[0].reason


def test_place_puts_every_layer_on_the_node_with_most_memory():
    state = apply(with_node(), NodeRegistered(node=NodeInfo(node_id="n2", memory_available=20_000)), 2)
    state, events = run(state, PlaceInstance(command_id="c1", model_id="org/builtin"))
    created, desire = events
    assert isinstance(desire, DesireSet) and desire.desire.replicas == 1 and desire.desire.desire_id == "c1"
    assert isinstance(created, InstanceCreated) and created.command_id == "c1" and created.instance.desire_id == "c1"
    assert created.instance.instance_id == "c1-1"
    (shard,) = created.instance.shards
    assert (shard.runner_id, shard.node_id, shard.start_layer, shard.end_layer) == ("c1-0", "n2", 0, 8)


def test_place_rejections():
    assert rejection(run(with_node(), PlaceInstance(command_id="c", model_id="no/such"))[1])[0] == "not_found"
    assert rejection(run(with_leader(), PlaceInstance(command_id="c", model_id="org/builtin"))[1])[0] == "unavailable"
    code, reason = rejection(run(with_node(memory=10), PlaceInstance(command_id="c", model_id="org/builtin"))[1])
    assert code == "conflict" and "org/builtin needs 1.0 kB;" in reason
    assert rejection(run(with_node(), PlaceInstance(command_id="c", model_id="org/builtin", min_nodes=2))[1])[0] == "conflict"


def test_generate_routes_to_the_least_busy_instance_and_is_idempotent():
    state, _ = run(with_node(), PlaceInstance(command_id="p1", model_id="org/builtin"))
    state, _ = run(state, PlaceInstance(command_id="p2", model_id="org/builtin"))
    first, second = state.instances_of("org/builtin")
    state, events = run(state, GenerateText(command_id="g1", model_id="org/builtin", params=GenerationParams(), at=5.0))
    assert isinstance(events[0], TaskCreated) and events[0].task.instance_id == first.instance_id
    assert events[0].task.created_at == 5.0
    state, events = run(state, GenerateText(command_id="g2", model_id="org/builtin"))
    assert events[0].task.instance_id == second.instance_id
    assert run(state, GenerateText(command_id="g1", model_id="org/builtin"))[1] == []


def test_generate_rejections():
    assert rejection(run(with_node(), GenerateText(command_id="g", model_id="no/such"))[1])[0] == "not_found"
    # With no instance, a request places one on demand (tests/test_on_demand.py) unless EXO_ON_DEMAND is off.
    off = decide(with_node(), GenerateText(command_id="g", model_id="org/builtin"), builtin_cards=BUILTIN,
                 ids=ids_for("g"), on_demand=False)
    assert rejection(off)[0] == "unavailable"


def test_cancel_and_delete_instance_end_open_tasks():
    state, _ = run(with_node(), PlaceInstance(command_id="p1", model_id="org/builtin"))
    state, _ = run(state, GenerateText(command_id="g1", model_id="org/builtin"))
    state, events = run(state, CancelTask(command_id="x1", task_id="g1"))
    assert events == [TaskCancelRequested(command_id="x1", task_id="g1")]
    assert run(state, CancelTask(command_id="x2", task_id="g1"))[1] == []  # twice is fine
    assert rejection(run(state, CancelTask(command_id="x3", task_id="nope"))[1])[0] == "not_found"
    state, _ = run(state, GenerateText(command_id="g2", model_id="org/builtin"))
    instance_id = state.tasks["g2"].instance_id
    state, events = run(state, DeleteInstance(command_id="d1", instance_id=instance_id))
    assert [type(e) for e in events] == [TaskFinished, TaskFinished, DesireEnded, InstanceDeleted]  # its last instance
    assert state.desires == {}
    assert state.tasks["g2"].status == "cancelled" and state.instances == {}
    assert rejection(run(state, DeleteInstance(command_id="d2", instance_id=instance_id))[1])[0] == "not_found"


def test_custom_cards():
    card = ModelCard(model_id="org/custom", n_layers=2)
    state, events = run(with_leader(), AddCustomCard(command_id="a1", card=card))
    assert events == [CustomCardAdded(command_id="a1", card=card)]
    assert rejection(run(state, AddCustomCard(command_id="a2", card=BUILTIN["org/builtin"]))[1])[0] == "conflict"
    bad = ModelCard(model_id="../etc/passwd")
    assert rejection(run(state, AddCustomCard(command_id="a3", card=bad))[1])[0] == "invalid"
    assert rejection(run(state, DeleteCustomCard(command_id="d0", model_id="org/builtin"))[1])[0] == "conflict"
    state, events = run(state, DeleteCustomCard(command_id="d1", model_id="org/custom"))
    assert events == [CustomCardDeleted(command_id="d1", model_id="org/custom")] and state.custom_model_cards == {}
    assert rejection(run(state, DeleteCustomCard(command_id="d2", model_id="org/custom"))[1])[0] == "not_found"


def test_a_command_the_log_already_answered_is_not_decided_again():
    card = ModelCard(model_id="org/custom", n_layers=2)
    state, events = run(with_leader(), AddCustomCard(command_id="a1", card=card))
    assert state.answered_commands == {"a1": 1}
    assert run(state, AddCustomCard(command_id="a1", card=card))[1] == []  # redelivered to a new master
    state, _ = run(state, DeleteCustomCard(command_id="d1", model_id="org/custom"))
    assert run(state, DeleteCustomCard(command_id="d1", model_id="org/custom"))[1] == []


def test_a_model_whose_instances_failed_is_refused_at_once_with_the_reason():
    from exo.core.events import RunnerStatusChanged

    state, _ = run(with_node(), PlaceInstance(command_id="a", model_id="org/builtin"))
    state, _ = run(state, PlaceInstance(command_id="b", model_id="org/builtin"))
    a, b = (state.instances[i] for i in ("a-1", "b-1"))

    def runner_is(state: State, instance, status: str, error: str = "") -> State:
        shard = instance.shards[0]
        event = RunnerStatusChanged(runner_id=shard.runner_id, instance_id=instance.instance_id, node_id=shard.node_id,
                                    status=status, error=error)
        return apply(state, event, state.last_seq + 1)

    state = runner_is(runner_is(state, a, "ready"), b, "failed", "out of memory")
    _, events = run(state, GenerateText(command_id="g1", model_id="org/builtin", params=GenerationParams()))
    assert events[0].task.instance_id == "a-1"  # the failed one is passed over
    state = runner_is(state, a, "failed", "out of memory")
    code, reason = rejection(run(state, GenerateText(command_id="g2", model_id="org/builtin",
                                                     params=GenerationParams()))[1])
    assert code == "unavailable" and reason.startswith("instance a-1 of 'org/builtin' failed on n1: out of memory;")
