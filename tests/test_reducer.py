"""The reducer on plain data: every event kind, skips that never raise, and bounded history."""

import msgspec
import pytest

from exo.core.apply import apply
from exo.core.events import (
    AnyEvent,
    CommandRejected,
    CustomCardAdded,
    CustomCardDeleted,
    InstanceCreated,
    InstanceDeleted,
    NodeRegistered,
    RunnerStatusChanged,
    TaskCancelRequested,
    TaskCreated,
    TaskFinished,
    TaskStarted,
    decode_event,
    encode_event,
)
from exo.core.state import MAX_FINISHED_TASKS, State, decode_state, encode_state
from exo.core.types import Instance, ModelCard, NodeInfo, ShardAssignment, Task
from tests.support import as_master

INSTANCE = Instance(instance_id="i1", model_id="m/a", shards=[ShardAssignment(runner_id="r1", node_id="n1", end_layer=2)])


def fold(events: list[AnyEvent], state: State | None = None) -> State:
    """The events folded in order, from `state` or else a State with a leader; a master's events
    without a term get the leader's (as the master stamps them)."""
    return as_master.fold(events, state)


def test_instance_lifecycle_creates_and_removes_its_runners():
    state = fold([InstanceCreated(instance=INSTANCE)])
    assert state.instances["i1"].created_seq == 1
    assert state.runners["r1"].status == "created" and state.runners["r1"].node_id == "n1"
    state = fold([RunnerStatusChanged(runner_id="r1", instance_id="i1", node_id="n1", status="ready")], state)
    assert state.runners["r1"].status == "ready"
    state = fold([InstanceDeleted(instance_id="i1")], state)
    assert state.instances == {} and state.runners == {} and state.last_seq == 3


def test_task_lifecycle():
    task = Task(task_id="t1", instance_id="i1", model_id="m/a")
    state = fold([InstanceCreated(instance=INSTANCE), TaskCreated(task=task), TaskStarted(task_id="t1"),
                  TaskCancelRequested(task_id="t1")])
    assert state.tasks["t1"].status == "running" and state.tasks["t1"].cancel_requested
    state = fold([TaskFinished(task_id="t1", status="cancelled", finish_reason="cancelled", completion_tokens=3)], state)
    assert state.tasks["t1"].status == "cancelled" and state.tasks["t1"].completion_tokens == 3
    assert state.open_tasks_of("i1") == []


def test_events_that_do_not_fit_are_skipped_with_a_reason_not_raised():
    state = fold([TaskStarted(task_id="nope"), InstanceDeleted(instance_id="gone"), CustomCardDeleted(model_id="x/y")])
    assert state.last_seq == 3
    assert [s.seq for s in state.skipped_events] == [1, 2, 3]
    assert "unknown task nope" in state.skipped_events[0].reason
    task = Task(task_id="t1", instance_id="i1", model_id="m/a")
    state = fold([TaskCreated(task=task), TaskFinished(task_id="t1", status="completed"), TaskStarted(task_id="t1")])
    assert state.tasks["t1"].status == "completed"
    assert "already completed" in state.skipped_events[-1].reason


def test_nodes_cards_and_rejections():
    card = ModelCard(model_id="org/custom", n_layers=4)
    state = fold([NodeRegistered(node=NodeInfo(node_id="n1", memory_total=10)), CustomCardAdded(card=card),
                  CommandRejected(command_id="c", reason="no")])
    assert state.nodes["n1"].memory_total == 10
    assert state.custom_model_cards == {"org/custom": card}
    assert fold([CustomCardDeleted(model_id="org/custom")], state).custom_model_cards == {}


def test_finished_tasks_are_bounded():
    events: list[AnyEvent] = []
    for n in range(MAX_FINISHED_TASKS + 5):
        events += [TaskCreated(task=Task(task_id=f"t{n}", instance_id="i", model_id="m")),
                   TaskFinished(task_id=f"t{n}", status="completed")]
    events.append(TaskCreated(task=Task(task_id="open", instance_id="i", model_id="m")))
    state = fold(events)
    assert len(state.tasks) == MAX_FINISHED_TASKS + 1
    assert "t0" not in state.tasks and f"t{MAX_FINISHED_TASKS + 4}" in state.tasks and "open" in state.tasks


def test_wire_format_is_tagged_and_tolerates_unknown_fields():
    event = TaskStarted(task_id="t1")
    assert msgspec.json.decode(encode_event(event)) == {"kind": "task.started", "term": 0, "task_id": "t1", "attempt": 0}
    assert decode_event(b'{"kind":"task.started","task_id":"t1","added_later":42}') == event
    with pytest.raises(msgspec.ValidationError):
        decode_event(b'{"kind":"no.such.event"}')


def test_state_round_trips_through_json():
    task = Task(task_id="t1", instance_id="i1", model_id="m/a")
    state = fold([InstanceCreated(instance=INSTANCE), TaskCreated(task=task), TaskStarted(task_id="nope")])
    assert decode_state(encode_state(state)) == state


def test_events_from_a_deposed_masters_term_are_ignored():
    from exo.core.events import LeaderElected

    state = fold([LeaderElected(node_id="a", term=3), InstanceCreated(instance=INSTANCE, term=3)], State())
    assert state.leader_term == 3 and state.leader_node == "a" and "i1" in state.instances
    state = fold([LeaderElected(node_id="b", term=7), InstanceDeleted(instance_id="i1", term=3)], state)
    assert "i1" in state.instances and "older than the leader's term 7" in state.skipped_events[-1].reason
    state = fold([LeaderElected(node_id="a", term=5)], state)  # an election that lost the race
    assert state.leader_node == "b" and state.leader_term == 7
    state = fold([InstanceDeleted(instance_id="i1", term=7), TaskStarted(task_id="x")], state)
    assert state.instances == {}


def test_cards_that_cannot_be_stored_are_skipped_not_folded():
    # A stray publisher's card.added with a path in its id once stopped every node from starting.
    from exo.core.events import CustomCardAdded
    from exo.core.types import ModelCard

    forged = [ModelCard(model_id="../../../../var/x", n_layers=2), ModelCard(model_id="a/b\n"),
              ModelCard(model_id="a/b", n_layers=-1), ModelCard(model_id="a/c", path="relative")]
    state = as_master.with_leader()
    for seq, card in enumerate(forged, start=1):
        state = apply(state, CustomCardAdded(card=card, term=state.leader_term), seq)
    assert state.custom_model_cards == {}
    assert [s.seq for s in state.skipped_events] == [1, 2, 3, 4]
    assert "invalid model id" in state.skipped_events[0].reason
    assert "must not be negative" in state.skipped_events[2].reason and "absolute" in state.skipped_events[3].reason


def test_a_worker_writes_only_valid_cards_of_an_old_state(tmp_path):
    # A State written before the reducer refused bad cards (e.g. an old snapshot) still starts a worker.
    from exo.core.types import ModelCard
    from exo.models.cards import reconcile_custom_cards

    good = ModelCard(model_id="org/good", n_layers=2)
    reconcile_custom_cards(tmp_path, {"org/good": good, "../x": ModelCard(model_id="../x", n_layers=2)})
    assert [p.name for p in tmp_path.iterdir()] == ["org--good.toml"]


@pytest.mark.parametrize(("fields", "reason"), [
    ({"n_layers": 10**30}, "n_layers 1000000000000000000000000000000 is over 4096"),
    ({"context_length": 1 << 30}, "context_length 1073741824 is over 134217728"),
    ({"head_dim": -64}, "head_dim must not be negative"),
    ({"kv_dtype_bytes": -2}, "kv_dtype_bytes must not be negative"),
    ({"kv_dtype_bytes": 3}, "kv_dtype_bytes must be 0 (2, the default), 1, 2, 4 or 8, not 3"),
    ({"sampling": {"temperature": -5}}, "sampling.temperature must be between 0 and 2, not -5.0"),
    ({"sampling_no_thinking": {"top_p": 1.5}}, "sampling_no_thinking.top_p must be between 0 and 1, not 1.5"),
])
def test_cards_out_of_range_are_refused_and_skipped(fields, reason):
    card = msgspec.convert({"model_id": "org/m", "n_layers": 2, **fields}, ModelCard)
    assert card.problem() == reason
    assert fold([CustomCardAdded(card=card)]).skipped_events[-1].reason == f"custom card: {reason}"
    assert ModelCard(model_id="org/m", n_layers=80, context_length=131072, head_dim=128, kv_dtype_bytes=2).problem() is None


def test_a_finished_tasks_params_keep_nothing_that_grows_with_the_request():
    """State keeps finished tasks (MAX_FINISHED_TASKS of them): their text, tools, grammar and
    logit_bias (up to 300 entries) stay in the log only, while the small settings stay."""
    from exo.core.conversation import without_text
    from exo.core.requests import ChatMessage, GenerationParams, ResponseFormat

    params = GenerationParams(messages=[ChatMessage(role="user", content="hi " * 100)], prompt="p" * 100,
                              tools=[{"type": "function", "function": {"name": "f"}}], stop=["x"],
                              response_format=ResponseFormat(type="json_object"),
                              logit_bias={n: 1.0 for n in range(300)}, temperature=0.5, seed=7)
    kept = without_text(params)
    assert (kept.messages, kept.prompt, kept.tools, kept.stop, kept.response_format, kept.logit_bias) == \
           ([], None, [], [], None, {})
    assert (kept.temperature, kept.seed) == (0.5, 7)
