"""The batch fold (`apply_all`, one `Draft` across many events) gives exactly the State that
folding `apply` one event at a time gives: same values, same dict order (snapshots are JSON
of it), and the States it started from or handed out are never changed afterwards."""

from __future__ import annotations

from functools import cache

import msgspec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from exo.core.apply import apply, apply_all, fold_into, skip_event
from exo.core.draft import Draft
from exo.core.events import (
    AnyEvent,
    CommandRejected,
    CustomCardAdded,
    CustomCardDeleted,
    DownloadDeleted,
    DownloadFailed,
    DownloadProgressed,
    InstanceCreated,
    InstanceDeleted,
    LeaderElected,
    NodeHeartbeat,
    NodeRegistered,
    NodeSuspected,
    NodeTimedOut,
    RunnerStatusChanged,
    TaskCancelRequested,
    TaskCreated,
    TaskFinished,
    TaskStarted,
)
from exo.core.state import MAX_ANSWERED_COMMANDS, MAX_FINISHED_TASKS, MAX_SKIPPED_KEPT, State, encode_state
from exo.core.types import DownloadProgress, Instance, ModelCard, NodeInfo, ShardAssignment, Task

# Small pools of ids, so that random events keep meeting each other (and unknown ids).
NODES = st.sampled_from(["n0", "n1", "n2"])
MODELS = st.sampled_from(["m/a", "m/b"])
INSTANCES = st.sampled_from(["i0", "i1", "i2"])
RUNNERS = st.sampled_from(["r0", "r1", "r2", "r3"])
TASKS = st.sampled_from(["t0", "t1", "t2", "t3", "t4", "t5"])
COMMANDS = st.sampled_from(["", "c0", "c1", "c2", "t0", "t1"])
TERMS = st.sampled_from([0, 0, 0, 1, 2, 3])
TEXT = st.sampled_from(["", "boom", "gone"])

node_info = st.builds(NodeInfo, node_id=NODES, memory_total=st.integers(0, 3), last_seen=st.floats(0, 2))
instance = st.builds(
    Instance, instance_id=INSTANCES, model_id=MODELS,
    shards=st.lists(st.builds(ShardAssignment, runner_id=RUNNERS, node_id=NODES), max_size=3),
)
progress = st.builds(DownloadProgress, node_id=NODES, model_id=MODELS, done_bytes=st.integers(0, 5),
                     status=st.sampled_from(["pending", "downloading", "completed"]))

EVENTS: st.SearchStrategy[AnyEvent] = st.one_of(
    st.builds(LeaderElected, node_id=NODES, term=st.integers(0, 4), lease_revision=st.sampled_from([0, 0, 3])),
    st.builds(NodeRegistered, node=node_info, term=TERMS),
    st.builds(NodeHeartbeat, node=node_info, term=TERMS),
    st.builds(NodeTimedOut, node_id=NODES, reason=TEXT, term=TERMS),
    st.builds(NodeSuspected, node_id=NODES, suspect=st.booleans(), at=st.sampled_from([0.0, 5.0]), term=TERMS),
    st.builds(InstanceCreated, command_id=COMMANDS, instance=instance, term=TERMS),
    st.builds(InstanceDeleted, command_id=COMMANDS, instance_id=INSTANCES, reason=TEXT, term=TERMS),
    st.builds(RunnerStatusChanged, runner_id=RUNNERS, instance_id=INSTANCES, node_id=NODES,
              status=st.sampled_from(["loading", "ready", "failed"]), error=TEXT, failures=st.integers(0, 3),
              term=TERMS),
    st.builds(TaskCreated, command_id=COMMANDS, term=TERMS,
              task=st.builds(Task, task_id=TASKS, instance_id=INSTANCES, model_id=MODELS)),
    st.builds(TaskCancelRequested, command_id=COMMANDS, task_id=TASKS, term=TERMS),
    st.builds(TaskStarted, task_id=TASKS, term=TERMS),
    st.builds(TaskFinished, task_id=TASKS, status=st.sampled_from(["completed", "cancelled", "failed"]),
              error=TEXT, completion_tokens=st.integers(0, 9), term=TERMS),
    st.builds(CustomCardAdded, command_id=COMMANDS, card=st.builds(ModelCard, model_id=MODELS,
                                                                    n_layers=st.integers(1, 4)), term=TERMS),
    st.builds(CustomCardDeleted, command_id=COMMANDS, model_id=MODELS, term=TERMS),
    st.builds(CommandRejected, command_id=st.sampled_from(["c0", "c3", "t2"]), reason=TEXT, term=TERMS),
    st.builds(DownloadProgressed, progress=progress, term=TERMS),
    st.builds(DownloadFailed, node_id=NODES, model_id=MODELS, reason=TEXT, at=st.floats(0, 2), term=TERMS),
    st.builds(DownloadDeleted, node_id=NODES, model_id=MODELS, term=TERMS),
)
# An item of a log: an event, or an undecodable payload (the reason a reader gives for it).
ITEMS = st.lists(st.one_of(EVENTS, EVENTS, EVENTS, st.just("undecodable payload")), max_size=60)


@cache
def nearly_full() -> State:
    """A State one step from every bound: finished tasks, answered commands, skipped events."""
    events: list[AnyEvent] = [LeaderElected(node_id="n0", term=1)]  # a master's events carry its term
    for n in range(MAX_FINISHED_TASKS - 1):
        events += [TaskCreated(command_id=f"old{n}", task=Task(task_id=f"old{n}", instance_id="i0", model_id="m/a"),
                               term=1),
                   TaskFinished(task_id=f"old{n}", status="completed")]
    events += [CommandRejected(command_id=f"rej{n}", term=1) for n in range(MAX_ANSWERED_COMMANDS - MAX_FINISHED_TASKS)]
    events += [TaskStarted(task_id="nope")] * (MAX_SKIPPED_KEPT - 1)
    events += [InstanceCreated(instance=Instance(
        instance_id="i0", model_id="m/a", shards=[ShardAssignment(runner_id="r0", node_id="n0")]), term=1)]
    state = State()
    for event in events:
        state = apply(state, event, state.last_seq + 1)
    assert len(state.finished_task_ids) == MAX_FINISHED_TASKS - 1
    assert len(state.answered_commands) == MAX_ANSWERED_COMMANDS - 1
    assert len(state.skipped_events) == MAX_SKIPPED_KEPT - 1
    return state


STARTS = st.sampled_from(["empty", "nearly full"]).map(lambda which: State() if which == "empty" else nearly_full())


def with_seqs(items: list, first: int, gaps: list[int]) -> list[tuple[object, int]]:
    seqs, seq = [], first
    for n in range(len(items)):
        seq += 1 + (gaps[n % len(gaps)] if gaps else 0)
        seqs.append(seq)
    return list(zip(items, seqs))


def one_by_one(state: State, log: list[tuple[object, int]]) -> list[State]:
    """Every State along the way, folding with `apply` (and `skip_event` for undecodable items)."""
    states = []
    for item, seq in log:
        state = skip_event(state, seq, item) if isinstance(item, str) else apply(state, item, seq)
        states.append(state)
    return states


settings.register_profile("fold", max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@settings(settings.get_profile("fold"))
@given(start=STARTS, events=st.lists(EVENTS, max_size=60), gaps=st.lists(st.integers(0, 2), max_size=3))
def test_apply_all_equals_folding_apply_one_by_one(start: State, events: list[AnyEvent], gaps: list[int]):
    log = with_seqs(events, start.last_seq, gaps)
    before = encode_state(start)
    expected = one_by_one(start, log)[-1] if log else start
    folded = apply_all(start, log)
    assert folded == expected
    assert encode_state(folded) == encode_state(expected)  # dict order too: snapshots are this JSON
    assert encode_state(start) == before  # the State it started from is untouched


@settings(settings.get_profile("fold"))
@given(start=STARTS, items=ITEMS, cuts=st.sets(st.integers(0, 60), max_size=6), gaps=st.lists(st.integers(0, 2)))
def test_one_draft_handing_out_states_along_the_way(start: State, items: list, cuts: set[int], gaps: list[int]):
    """What the replayer does: one draft, undecodable items skipped, State taken at checkpoints
    (which must stay as they were while the draft goes on), skip reasons as `apply` records them."""
    log = with_seqs(items, start.last_seq, gaps)
    expected = one_by_one(start, log)
    draft, taken = Draft(start), []
    for index, (item, seq) in enumerate(log):
        if isinstance(item, str):
            draft.skip(seq, item)
            reason = item
        else:
            reason = fold_into(draft, item, seq)
        used = expected[index].skipped_events is (expected[index - 1] if index else start).skipped_events
        assert reason == ("" if used else expected[index].skipped_events[-1].reason)
        if index in cuts:
            state = draft.state()
            taken.append((index, state, encode_state(state)))
    for index, state, encoded in taken:
        assert state == expected[index] and encode_state(state) == encoded
    final = draft.state()
    assert encode_state(final) == encode_state(expected[-1] if log else start)


def test_bounded_lists_drop_the_oldest_in_a_batch_as_one_by_one():
    start = nearly_full()
    log = []
    for n in range(3):
        log += [TaskCreated(command_id=f"new{n}", task=Task(task_id=f"new{n}", instance_id="i0", model_id="m/a"), term=1),
                TaskFinished(task_id=f"new{n}", status="completed"), TaskStarted(task_id=f"unknown{n}")]
    log = with_seqs(log, start.last_seq, [])
    folded = apply_all(start, log)
    assert encode_state(folded) == encode_state(one_by_one(start, log)[-1])
    assert len(folded.finished_task_ids) == MAX_FINISHED_TASKS and folded.finished_task_ids[-1] == "new2"
    assert "old0" not in folded.tasks and "old1" not in folded.tasks and "old2" in folded.tasks
    assert len(folded.answered_commands) == MAX_ANSWERED_COMMANDS and "old0" not in folded.answered_commands
    assert len(folded.skipped_events) == MAX_SKIPPED_KEPT and folded.skipped_events[-1].reason == "unknown task unknown2"


def test_a_deposed_masters_events_are_skipped_in_a_batch_too():
    start = nearly_full()  # leader term 1
    log = with_seqs([LeaderElected(node_id="n1", term=3), InstanceDeleted(instance_id="i0", term=2),
                     LeaderElected(node_id="n2", term=3), InstanceDeleted(instance_id="i0", term=3)],
                    start.last_seq, [])
    folded = apply_all(start, log)
    assert encode_state(folded) == encode_state(one_by_one(start, log)[-1])
    reasons = [s.reason for s in folded.skipped_events[-2:]]
    assert reasons == ["from term 2, older than the leader's term 3", "leader term 3 is not newer than 3"]
    assert folded.leader_node == "n1" and "i0" not in folded.instances
    assert folded.instance_end_reasons == {"m/a": "deleted"}


def test_a_nodes_downloads_deleted_then_begun_again_in_one_batch():
    """A draft that drops a node's emptied map of downloads forgets it copied that map: the
    node's next download in the same batch starts a fresh map instead of failing."""
    log = with_seqs([DownloadProgressed(progress=DownloadProgress(node_id="n0", model_id="m/a")),
                     DownloadDeleted(node_id="n0", model_id="m/a"),
                     DownloadProgressed(progress=DownloadProgress(node_id="n0", model_id="m/b", done_bytes=3))], 0, [])
    folded = apply_all(State(), log)
    assert folded.downloads == {"n0": {"m/b": DownloadProgress(node_id="n0", model_id="m/b", done_bytes=3)}}
    assert encode_state(folded) == encode_state(one_by_one(State(), log)[-1])
    assert folded.skipped_events == []


def test_a_draft_carries_every_field_of_state():
    """A field added to State and not carried by Draft would silently reset on every event."""
    values = {}
    for field in msgspec.structs.fields(State):
        if field.type is int:
            values[field.name] = int("987654321")  # not an interned small int
        elif field.type is str:
            values[field.name] = f"kept-{field.name}"
        elif field.type is bool:
            values[field.name] = not field.default
        else:
            values[field.name] = msgspec.convert(msgspec.to_builtins(getattr(State(), field.name)), field.type)
    start = State(**values)
    carried = Draft(start).state()
    assert carried == start
    assert all(getattr(carried, name) is getattr(start, name) for name in State.__struct_fields__ if name != "leader_by_sequence")
