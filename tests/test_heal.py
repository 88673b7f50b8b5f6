"""Self-healing on plain data (exo/master/heal.py, supervise.py): desires kept placed with their
replicas, suspect nodes, generations moved to another instance or waiting for the replacement,
deadlines, back-off, and the reducer's rules for a task's runs."""

import itertools

from exo.bus.token_stream import chain_of
from exo.core.apply import apply
from exo.core.commands import DeleteDesire, DeleteInstance, GenerateText, PlaceInstance
from exo.core.events import (
    DesireEnded,
    DesireSet,
    InstanceCreated,
    InstanceDeleted,
    NodeRegistered,
    NodeTimedOut,
    TaskFinished,
    TaskMigrated,
    TaskStarted,
)
from exo.core.requests import TokenChunk
from exo.core.state import State
from exo.core.types import ModelCard, NodeInfo
from exo.master.decide import decide
from exo.master.heal import HealLimits
from exo.master.supervise import supervise
from tests.support.as_master import stamped, with_leader

CARD = ModelCard(model_id="org/m", n_layers=8, storage_bytes=1000)
BUILTIN = {"org/m": CARD}
LIMITS = HealLimits(suspect_s=5, deadline_s=120, max_migrations=2)


def fold(state: State, events) -> State:
    for event in events:
        state = apply(state, stamped(state, event), state.last_seq + 1)
    return state


def cluster(*names: str, memory: int = 10_000) -> State:
    return fold(with_leader(), [NodeRegistered(node=NodeInfo(node_id=n, memory_available=memory)) for n in names])


def command(state: State, cmd) -> tuple[State, list]:
    events = decide(state, cmd, builtin_cards=BUILTIN, ids=(f"{cmd.command_id}-{n}" for n in itertools.count()))
    return fold(state, events), events


def tick(state: State, heard: dict, now: float, seed: str = "h") -> tuple[State, list]:
    events = supervise(state, heard, now, node_timeout=30, wall_now=1000 + now, limits=LIMITS, builtin=BUILTIN,
                       ids=(f"{seed}{state.last_seq}-{n}" for n in itertools.count()))
    return fold(state, events), events


def chat(state: State, task_id: str) -> State:
    return command(state, GenerateText(command_id=task_id, model_id="org/m", at=1000.0))[0]


def node_of(state: State, instance_id: str) -> str:
    return state.instances[instance_id].shards[0].node_id


def test_replicas_go_to_distinct_nodes_and_the_desire_is_kept():
    state, events = command(cluster("a", "b"), PlaceInstance(command_id="p", model_id="org/m", replicas=2))
    assert [type(e) for e in events] == [InstanceCreated, DesireSet, InstanceCreated]
    assert {node_of(state, i) for i in state.instances} == {"a", "b"}
    assert state.desires["p"].replicas == 2 and {i.desire_id for i in state.instances.values()} == {"p"}
    # One node only: both replicas still fit on it (memory allows), so both are placed there.
    state, _ = command(cluster("a"), PlaceInstance(command_id="p", model_id="org/m", replicas=2))
    assert len(state.instances) == 2


def test_a_suspect_nodes_generation_moves_to_the_replica_at_once():
    state, _ = command(cluster("a", "b"), PlaceInstance(command_id="p", model_id="org/m", replicas=2))
    state = chat(state, "t1")
    doomed = state.tasks["t1"].instance_id
    dead = node_of(state, doomed)
    alive = "b" if dead == "a" else "a"
    heard = {dead: 0.0, alive: 6.0}
    assert tick(state, {dead: 2.0, alive: 6.0}, now=6.0)[1] == []  # 4 s of silence: not yet suspect
    state, events = tick(state, heard, now=6.0)
    moved, deleted = events
    assert isinstance(moved, TaskMigrated) and moved.to_instance != doomed and moved.to_instance in state.instances
    assert f"node {dead} is suspect: no pulse for 5 s" in moved.reason and isinstance(deleted, InstanceDeleted)
    task = state.tasks["t1"]
    assert task.status == "pending" and task.instance_id == moved.to_instance and len(task.migrations) == 1
    assert task.migrations[0].from_instance == doomed and state.migrations_total == 1
    # The next tick places the missing replica, but not on the suspect node.
    state, events = tick(state, heard, now=7.0)
    (created,) = events
    assert isinstance(created, InstanceCreated) and created.instance.desire_id == "p"
    assert node_of(state, created.instance.instance_id) == alive


def test_without_a_replica_the_generation_waits_for_the_replacement():
    state, _ = command(cluster("a", "b"), PlaceInstance(command_id="p", model_id="org/m"))
    state = chat(state, "t1")
    dead = node_of(state, state.tasks["t1"].instance_id)
    alive = "b" if dead == "a" else "a"
    heard = {dead: 0.0, alive: 6.0}
    state, events = tick(state, heard, now=6.0)
    assert isinstance(events[0], TaskMigrated) and events[0].to_instance == "" and state.tasks["t1"].instance_id == ""
    state, (created,) = tick(state, heard, now=7.0)
    assert isinstance(created, InstanceCreated) and node_of(state, created.instance.instance_id) == alive
    state, (moved,) = tick(state, heard, now=8.0)
    assert moved == TaskMigrated(task_id="t1", to_instance=created.instance.instance_id,
                                 reason="an instance of its model is ready", at=1008.0)
    task = state.tasks["t1"]
    assert len(task.migrations) == 1 and task.migrations[0].to_instance == created.instance.instance_id
    assert state.migrations_total == 1  # waiting, then taken: one move


def test_a_waiting_generation_ends_with_the_reason_past_the_deadline():
    state = fold(cluster("a"), [NodeRegistered(node=NodeInfo(node_id="b", memory_available=10))])  # b: too small
    state, _ = command(state, PlaceInstance(command_id="p", model_id="org/m"))
    state = chat(state, "t1")

    def heard(now: float) -> dict:
        return {"a": 0.0, "b": now}

    state, _ = tick(state, heard(6.0), now=6.0)  # a is suspect; b cannot hold the model
    state, events = tick(state, heard(7.0), now=7.0)
    assert events == [DesireSet(desire=state.desires["p"])] and "needs 1.0 kB" in state.desires["p"].waiting
    state, events = tick(state, heard(100.0), now=100.0)
    assert [type(e) for e in events] == [NodeTimedOut]  # a leaves State; the task still waits (within 120 s)
    state, (ended,) = tick(state, heard(127.0), now=127.0)
    assert isinstance(ended, TaskFinished) and ended.status == "failed"
    assert "waited 121 s" in ended.error and "needs 1.0 kB" in ended.error


def test_a_node_that_joins_with_room_gets_the_waiting_desire():
    state, _ = command(cluster("a", memory=10_000), PlaceInstance(command_id="p", model_id="org/m", min_nodes=1))
    state, _ = tick(state, {"a": 0.0}, now=6.0)
    state, _ = tick(state, {"a": 0.0}, now=7.0)
    assert state.desires["p"].waiting
    state = fold(state, [NodeRegistered(node=NodeInfo(node_id="c", memory_available=10_000))])
    state, (created,) = tick(state, {"a": 0.0, "c": 8.0}, now=8.0)
    assert isinstance(created, InstanceCreated) and node_of(state, created.instance.instance_id) == "c"
    state, (cleared,) = tick(state, {"a": 0.0, "c": 9.0}, now=9.0)
    assert isinstance(cleared, DesireSet) and cleared.desire.waiting == ""


def test_a_generation_moves_at_most_max_migrations_times():
    state, _ = command(cluster("a", "b", "c", "d"), PlaceInstance(command_id="p", model_id="org/m", replicas=4))
    state = chat(state, "t1")
    silent: set[str] = set()
    for now in (6.0, 7.0, 8.0):  # each time, the node holding the generation goes silent
        silent.add(node_of(state, state.tasks["t1"].instance_id))
        state, events = tick(state, {n: (0.0 if n in silent else now) for n in "abcd"}, now=now)
        moved = [e for e in events if isinstance(e, TaskMigrated)]
        if now < 8.0:
            assert moved and moved[0].to_instance, events
    ended = next(e for e in events if isinstance(e, TaskFinished))
    assert ended.status == "failed" and "moved 2 time(s) already" in ended.error
    assert len(state.tasks["t1"].migrations) == 2


def test_an_instance_that_keeps_failing_is_replaced_after_a_back_off():
    from exo.core.events import RunnerStatusChanged

    state, _ = command(cluster("a"), PlaceInstance(command_id="p", model_id="org/m"))
    (instance,) = state.instances.values()
    runner = instance.shards[0].runner_id
    state = fold(state, [RunnerStatusChanged(runner_id=runner, instance_id=instance.instance_id, node_id="a",
                                             status="failed", failures=3, error="boom")])
    state, events = tick(state, {"a": 1.0}, now=1.0)
    assert [type(e) for e in events] == [DesireSet, InstanceDeleted]
    assert state.desires["p"].failures == 1 and state.desires["p"].retry_at == 1001.0 + 2
    assert tick(state, {"a": 2.0}, now=2.0)[1] == []  # backing off
    state, (created,) = tick(state, {"a": 3.0}, now=3.0)
    assert isinstance(created, InstanceCreated)


def test_deleting_instances_lowers_replicas_then_ends_the_desire():
    state, _ = command(cluster("a", "b"), PlaceInstance(command_id="p", model_id="org/m", replicas=2))
    first, second = sorted(state.instances)
    state, events = command(state, DeleteInstance(command_id="d1", instance_id=first))
    assert state.desires["p"].replicas == 1
    state, events = command(state, DeleteInstance(command_id="d2", instance_id=second))
    assert any(isinstance(e, DesireEnded) for e in events) and state.desires == {}
    assert tick(state, {"a": 1.0, "b": 1.0}, now=1.0)[1] == []  # nothing to keep placed
    state, _ = command(cluster("a", "b"), PlaceInstance(command_id="p", model_id="org/m", replicas=2))
    state, events = command(state, DeleteDesire(command_id="d3", desire_id="p"))
    assert state.instances == {} and state.desires == {}


def test_a_runs_start_and_end_count_only_from_its_current_run():
    state, _ = command(cluster("a", "b"), PlaceInstance(command_id="p", model_id="org/m", replicas=2))
    state = chat(state, "t1")
    state = fold(state, [TaskStarted(task_id="t1")])
    dead = node_of(state, state.tasks["t1"].instance_id)
    state, _ = tick(state, {dead: 0.0, ("b" if dead == "a" else "a"): 6.0}, now=6.0)
    late = fold(state, [TaskFinished(task_id="t1", status="completed", attempt=0)])  # the paused node woke up
    assert late.tasks["t1"].status == "pending" and "on run 1" in late.skipped_events[-1].reason
    done = fold(state, [TaskStarted(task_id="t1", attempt=1), TaskFinished(task_id="t1", status="completed", attempt=1)])
    assert done.tasks["t1"].status == "completed"


def chunk(index: int, ids: list[int], attempt: int = 0) -> TokenChunk:
    return TokenChunk(command_id="c", index=index, text="x", token_ids=ids, attempt=attempt)


def test_the_resume_point_follows_each_run_from_where_it_resumed():
    assert chain_of([]) == ([], 0)
    assert chain_of([chunk(0, [1, 2]), chunk(1, [3]), chunk(3, [9])]) == ([1, 2, 3], 2)  # up to the gap
    # Run 1 resumed at index 1: run 0's late index 1 and 2 (a paused node that woke) do not count.
    mixed = [chunk(0, [1]), chunk(1, [2]), chunk(1, [20], attempt=1), chunk(2, [3]), chunk(2, [30], attempt=1),
             chunk(3, [4])]
    assert chain_of(mixed) == ([1, 20, 30], 3)


def test_a_new_run_resuming_before_what_the_stream_gave_skips_that_text_once():
    from exo.api.generation import RunTracker

    runs = RunTracker()
    given = [runs.trimmed(TokenChunk(command_id="c", index=i, text=t)) for i, t in enumerate(["Hel", "lo", " wo"])]
    assert [c.text for c in given] == ["Hel", "lo", " wo"]
    # Run 1 took over from index 1 (chunks 1 and 2 were given but never stored): it sends their text again.
    assert runs.begin(1, first_index=1, next_index=3) == 1
    again = [runs.trimmed(TokenChunk(command_id="c", index=i, text=t, attempt=1)) for i, t in ((1, "lo w"), (2, "orld"))]
    assert [c.text for c in again] == ["", "rld"]
    assert "".join(c.text for c in given + again) == "Hello world"


def test_a_replacement_does_not_take_the_ring_port_its_predecessor_held():
    """The old instance's runner on a surviving node may still hold its port while it stops: a peer
    of the replacement connecting there would join the stale process (seen: the group never formed)."""
    nodes = [NodeRegistered(node=NodeInfo(node_id=n, memory_available=10_000, addresses=[f"10.0.0.{i}"],
                                          ring_port_first=5000, ring_port_count=21)) for i, n in enumerate("abc")]
    state = fold(with_leader(), nodes)
    state, _ = command(state, PlaceInstance(command_id="p", model_id="org/m", sharding="pipeline", min_nodes=2))
    (old,) = state.instances.values()
    ports = {s.node_id: s.ring_address for s in old.shards}
    dead = old.shards[1].node_id
    heard = {n: (0.0 if n == dead else 6.0) for n in "abc"}
    state, _ = tick(state, heard, now=6.0)
    state, (created,) = tick(state, heard, now=7.0)
    survivor = old.shards[0].node_id
    again = next(s for s in created.instance.shards if s.node_id == survivor)
    assert again.ring_address != ports[survivor], (again.ring_address, ports)
