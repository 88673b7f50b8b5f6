"""DELETE of an adapter that requests use waits for them (issue 48): decided on State alone, so a
master after a failover finishes it. The end to end check (mlx-lm's exact text for the request that
ran on, the DELETE answering 200 after it) is in tests/test_adapter_rows.py."""

from __future__ import annotations

from exo.core.adapters import Adapter
from exo.core.commands import AddAdapter, AnyCommand, DeleteAdapter, GenerateText, PlaceInstance
from exo.core.events import (
    AdapterAdded,
    AdapterDeleted,
    AdapterDeleting,
    AnyEvent,
    CommandRejected,
    Event,
    InstanceCreated,
    LeaderElected,
    NodeRegistered,
    TaskCreated,
    TaskFinished,
    TaskStarted,
)
from exo.core.ids import NodeId
from exo.core.requests import GenerationParams
from exo.core.state import State
from exo.core.types import Instance, ModelCard, NodeInfo, ShardAssignment, Task
from exo.master.decide import decide
from exo.master.supervise import supervise
from tests.support import as_master

BASE = "org/tiny"
CARDS = {BASE: ModelCard(model_id=BASE, n_layers=2, hidden_size=64)}
PIRATE = Adapter(name="pirate", base_model=BASE, digest="a" * 64, size=10, config="{}")
INSTANCE = Instance(instance_id="i1", model_id=BASE, shards=[ShardAssignment(runner_id="r1", node_id="n1", end_layer=2)])


def _decide(state: State, command: AnyCommand) -> list[Event]:
    return decide(state, command, builtin_cards=CARDS, ids=iter(f"id{n}" for n in range(99)), on_demand=False)


def _ask(state: State, command_id: str, model: str = PIRATE.model_id) -> list[Event]:
    return _decide(state, GenerateText(command_id=command_id, model_id=model, params=GenerationParams()))


def _deleted_by_supervision(state: State) -> list[Event]:
    return [e for e in supervise(state, {NodeId("n1"): 0.0}, 0.0) if isinstance(e, AdapterDeleted)]


def _serving() -> State:
    """A base instance on n1 serving one running request for the adapter."""
    state = as_master.fold([NodeRegistered(node=NodeInfo(node_id="n1")), InstanceCreated(instance=INSTANCE),
                            AdapterAdded(adapter=PIRATE)])
    [created] = _ask(state, "t1")
    assert isinstance(created, TaskCreated) and created.task.instance_id == "i1"
    return as_master.fold([created, TaskStarted(task_id="t1")], state)


def test_an_adapter_no_request_uses_is_deleted_at_once():
    state = as_master.fold([AdapterAdded(adapter=PIRATE)])
    assert _decide(state, DeleteAdapter(command_id="d", name="pirate")) == [AdapterDeleted(command_id="d", name="pirate")]


def test_a_used_adapter_is_marked_refused_to_new_requests_and_deleted_when_its_last_request_ends():
    state = _serving()
    [marked] = _decide(state, DeleteAdapter(command_id="d", name="pirate"))
    assert marked == AdapterDeleting(command_id="d", name="pirate")
    state = as_master.fold([marked], state)
    assert state.adapters["pirate"].deleting and "d" in state.answered_commands
    for refused in (_ask(state, "t2"), _decide(state, PlaceInstance(command_id="p", model_id=PIRATE.model_id))):
        assert isinstance(refused[0], CommandRejected) and refused[0].code == "not_found", refused
        assert "being deleted" in refused[0].reason
    assert isinstance(_ask(state, "t3", BASE)[0], TaskCreated)  # the bare base is served as before
    [again] = _decide(state, AddAdapter(command_id="a", adapter=PIRATE))
    assert isinstance(again, CommandRejected) and again.code == "conflict" and "being deleted" in again.reason
    # A second DELETE is answered, and waits for the same end.
    [second] = _decide(state, DeleteAdapter(command_id="d2", name="pirate"))
    state = as_master.fold([second], state)
    assert isinstance(second, AdapterDeleting) and "d2" in state.answered_commands
    assert _deleted_by_supervision(state) == []  # t1 runs on
    state = as_master.fold([TaskFinished(task_id="t1", status="completed", finish_reason="length")], state)
    [deleted] = _deleted_by_supervision(state)
    assert deleted == AdapterDeleted(name="pirate")
    assert "pirate" not in as_master.fold([deleted], state).adapters


def test_a_queued_request_waiting_for_an_instance_holds_the_deletion_too():
    waiting = Task(task_id="w", instance_id="", model_id=PIRATE.model_id)  # as on demand queues it
    state = as_master.fold([AdapterAdded(adapter=PIRATE), TaskCreated(task=waiting)])
    assert isinstance(_decide(state, DeleteAdapter(command_id="d", name="pirate"))[0], AdapterDeleting)


def test_a_new_master_finishes_a_deletion_from_the_log_alone():
    """The master that marked it is gone; its successor folds the same log and, on its own
    supervision round, deletes the adapter once the request ends (and not before)."""
    state = _serving()
    log: list[AnyEvent] = [*_decide(state, DeleteAdapter(command_id="d", name="pirate"))]  # type: ignore[list-item]
    state = as_master.fold(log, state)
    successor = as_master.fold([LeaderElected(node_id="n2", lease_revision=99)], state)
    assert successor.leader_node == "n2" and successor.adapters["pirate"].deleting
    assert _deleted_by_supervision(successor) == []
    successor = as_master.fold([TaskFinished(task_id="t1", status="cancelled", finish_reason="cancelled")], successor)
    [deleted] = _deleted_by_supervision(successor)
    assert "pirate" not in as_master.fold([deleted], successor).adapters  # accepted under the new term


def test_the_mark_is_skipped_for_an_unknown_adapter_and_needs_a_masters_term():
    state = as_master.fold([AdapterDeleting(name="nobody")])
    assert "unknown adapter nobody" in state.skipped_events[-1].reason
    state = as_master.fold([AdapterAdded(adapter=PIRATE)])
    from exo.core.apply import apply

    forged = apply(state, AdapterDeleting(name="pirate"), state.last_seq + 1)  # term 0: not a master's
    assert not forged.adapters["pirate"].deleting
