"""Admission in the master's pure decide: a bounded queue per instance, beyond it "overloaded"; a
request of n choices (or best_of candidates) takes n places, as it takes n rows of a batch."""

import itertools

from exo.core.apply import apply
from exo.core.commands import GenerateText, PlaceInstance
from exo.core.events import CommandRejected, NodeRegistered, TaskCreated, TaskFinished
from exo.core.requests import GenerationParams
from exo.core.state import State
from exo.core.types import ModelCard, NodeInfo
from exo.master.decide import DEFAULT_MAX_QUEUE, decide
from tests.support.as_master import stamped, with_leader

CARDS = {"org/m": ModelCard(model_id="org/m", n_layers=4, storage_bytes=100)}


def run(state: State, command, **kwargs) -> tuple[State, list]:
    ids = (f"{command.command_id}-{n}" for n in itertools.count())
    events = decide(state, command, builtin_cards=CARDS, ids=ids, **kwargs)
    for event in events:
        state = apply(state, stamped(state, event), state.last_seq + 1)
    return state, events


def placed(max_queue: int = 0, instances: int = 1) -> State:
    state = apply(with_leader(), NodeRegistered(node=NodeInfo(node_id="n1", memory_available=10**9)), 1)
    for n in range(instances):
        state, _ = run(state, PlaceInstance(command_id=f"p{n}", model_id="org/m", max_queue=max_queue))
    return state


def generate(state: State, n: int, **kwargs) -> tuple[State, list]:
    return run(state, GenerateText(command_id=f"g{n}", model_id="org/m"), **kwargs)


def test_an_instance_admits_max_queue_open_tasks_then_refuses_as_overloaded():
    state = placed(max_queue=2)
    (instance,) = state.instances.values()
    assert instance.max_queue == 2
    state, first = generate(state, 1)
    state, second = generate(state, 2)
    assert isinstance(first[0], TaskCreated) and isinstance(second[0], TaskCreated)
    state, third = generate(state, 3)
    assert len(third) == 1 and isinstance(third[0], CommandRejected)
    assert third[0].code == "overloaded" and "full queue" in third[0].reason
    assert "g3" not in state.tasks


def test_a_finished_task_frees_its_place_in_the_queue():
    state = placed(max_queue=1)
    state, _ = generate(state, 1)
    state, refused = generate(state, 2)
    assert refused[0].code == "overloaded"
    state = apply(state, TaskFinished(task_id="g1", status="completed"), state.last_seq + 1)
    state, admitted = generate(state, 3)
    assert isinstance(admitted[0], TaskCreated)


def test_a_full_instance_sends_work_to_one_with_room():
    state = placed(max_queue=1, instances=2)
    state, first = generate(state, 1)
    state, second = generate(state, 2)
    assert {first[0].task.instance_id, second[0].task.instance_id} == set(state.instances)
    state, third = generate(state, 3)
    assert third[0].code == "overloaded"


def test_instances_without_their_own_limit_use_the_masters_default():
    state = placed()
    assert next(iter(state.instances.values())).max_queue == 0
    for n in range(3):
        state, events = generate(state, n, default_max_queue=3)
        assert isinstance(events[0], TaskCreated)
    state, events = generate(state, 99, default_max_queue=3)
    assert events[0].code == "overloaded"
    assert DEFAULT_MAX_QUEUE >= 32  # the default admits a benchmark's concurrency


def rows(state: State, name: str, n: int = 1, best_of: int = 0) -> tuple[State, list]:
    """A request decoding max(n, best_of) rows of a batch."""
    return run(state, GenerateText(command_id=name, model_id="org/m", params=GenerationParams(n=n, best_of=best_of)))


def outcome(events: list) -> str:
    return events[0].code if isinstance(events[0], CommandRejected) else type(events[0]).__name__


def test_a_request_of_n_choices_takes_n_places_in_the_queue():
    state = placed(max_queue=4)
    outcomes = []
    for name, n, best_of in [("three", 3, 0), ("two", 1, 2), ("one", 1, 0), ("full", 1, 0)]:
        state, events = rows(state, name, n, best_of)
        outcomes.append(outcome(events))
    assert outcomes == ["TaskCreated", "overloaded", "TaskCreated", "overloaded"]  # 3; 3 + 2 > 4; 3 + 1 = 4; full
    assert sorted(state.tasks) == ["one", "three"]
    state = apply(state, TaskFinished(task_id="three", status="completed"), state.last_seq + 1)
    state, again = rows(state, "again", n=2, best_of=3)  # 1 + 3 = 4: its three places came back
    assert outcome(again) == "TaskCreated"


def test_more_choices_than_any_instance_queues_is_a_400_not_a_429_to_retry():
    state = placed(max_queue=4)
    state, events = rows(state, "five", n=5)
    assert (len(events), outcome(events)) == (1, "invalid")
    assert events[0].reason == ("this request's 5 choices (n or best_of) count as 5 requests, more than the 4 open "
                                "requests an instance of 'org/m' admits: send a smaller n")


def test_the_least_busy_instance_is_the_one_with_fewest_rows_open():
    state = placed(instances=2)
    first, second = (i.instance_id for i in state.instances_of("org/m"))
    state, three = rows(state, "three", n=3)
    state, one = rows(state, "one")
    state, next_one = rows(state, "next")  # 3 rows against 1: not one task against one
    assert [e.task.instance_id for e in (*three, *one, *next_one)] == [first, second, second]
