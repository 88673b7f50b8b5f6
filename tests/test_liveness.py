"""Node liveness and runner recovery on plain data: the master's supervision (timeouts, failing
instances), the worker's plan for multi-rank instances (group forming, peer failure, restarts
with back-off), heartbeats in the reducer, and node ids that survive restarts but not copies."""

from pathlib import Path

import pytest
from msgspec.structs import replace

from exo.core.apply import apply
from exo.core.commands import GenerateText
from exo.core.events import (
    InstanceCreated,
    InstanceDeleted,
    NodeHeartbeat,
    NodeRegistered,
    NodeTimedOut,
    RunnerStatusChanged,
    TaskCreated,
    TaskFinished,
)
from exo.core.state import State
from exo.core.types import Instance, NodeInfo, ShardAssignment, Task
from exo.identity import IdentityError, load_node_id, lock_data_dir
from exo.master.decide import decide
from exo.master.supervise import failing_instances, silent_nodes, supervise, time_out_node
from exo.worker.plan import (
    AbandonRunner,
    DownloadModel,
    EndTask,
    ForwardTask,
    LoadModel,
    LocalRunner,
    RestartRunner,
    WorkerView,
    plan,
    restart_due,
)
from tests.support.as_master import stamped, with_leader

TWO_RANKS = Instance(instance_id="i1", model_id="m/a", sharding="tensor", shards=[
    ShardAssignment(runner_id="r0", node_id="a", rank=0, world_size=2, end_layer=4, ring_address="10.0.0.1:5000"),
    ShardAssignment(runner_id="r1", node_id="b", rank=1, world_size=2, end_layer=4, ring_address="10.0.0.2:5000"),
])


def state_with(*events) -> State:
    state = with_leader()
    for event in events:
        state = apply(state, stamped(state, event), state.last_seq + 1)
    return state


def node(node_id: str) -> NodeInfo:
    return NodeInfo(node_id=node_id, name=f"mac-{node_id}", memory_available=1 << 30)


def status(runner_id: str, value: str, failures: int = 0, error: str = "") -> RunnerStatusChanged:
    node_id = "a" if runner_id == "r0" else "b"
    return RunnerStatusChanged(runner_id=runner_id, instance_id="i1", node_id=node_id, status=value,
                               failures=failures, error=error)


CLUSTER = (NodeRegistered(node=node("a")), NodeRegistered(node=node("b")), InstanceCreated(instance=TWO_RANKS))


def test_heartbeats_update_the_node_and_a_timeout_removes_it():
    state = state_with(NodeRegistered(node=node("a")), NodeHeartbeat(node=NodeInfo(node_id="a", memory_available=5)))
    assert state.nodes["a"].memory_available == 5
    state = state_with(NodeRegistered(node=node("a")), NodeTimedOut(node_id="a", reason="gone"))
    assert state.nodes == {}


def test_silent_nodes_are_timed_out_with_their_instances_and_open_tasks():
    task = Task(task_id="t1", instance_id="i1", model_id="m/a")
    state = state_with(*CLUSTER, TaskCreated(task=task))
    assert silent_nodes(state, {"a": 100.0, "b": 71.0}, now=100.0, timeout=30) == []
    assert silent_nodes(state, {"a": 100.0, "b": 70.0}, now=100.0, timeout=30) == ["b"]
    reason = "node mac-b timed out: no heartbeat for 30 s"  # State and the 503 name it
    assert time_out_node(state, "b", 30) == [
        TaskFinished(task_id="t1", status="failed", finish_reason="error", error=f"instance deleted: {reason}"),
        InstanceDeleted(instance_id="i1", reason=reason),
        NodeTimedOut(node_id="b", reason=reason),
    ]
    after = state_with(*CLUSTER, TaskCreated(task=task), *time_out_node(state, "b", 30))
    assert after.instances == {} and list(after.nodes) == ["a"] and after.tasks["t1"].status == "failed"
    answer = decide(after, GenerateText(command_id="c1", model_id="m/a"), builtin_cards={"m/a": _card()}, ids=iter([]),
                    on_demand=False)
    assert answer[0].code == "unavailable"
    assert answer[0].reason == f"no instance of 'm/a' is running (its last instance was deleted: {reason}); place one first"


def _card():
    from exo.core.types import ModelCard
    return ModelCard(model_id="m/a", storage_bytes=1000)


def test_an_instance_whose_runner_keeps_failing_is_deleted_with_the_reason():
    state = state_with(*CLUSTER, status("r1", "failed", failures=2, error="boom"))
    assert failing_instances(state, max_failures=3) == []
    state = state_with(*CLUSTER, status("r1", "failed", failures=3, error="boom"))
    assert failing_instances(state, max_failures=3) == [
        InstanceDeleted(instance_id="i1", reason="runner r1 on node mac-b failed 3 times: boom")]
    # A node that timed out is handled once: its instance is not deleted a second time.
    events = supervise(state, {"a": 0.0, "b": 0.0}, now=100.0, node_timeout=30)
    assert [type(e).__name__ for e in events] == ["InstanceDeleted", "NodeTimedOut", "NodeTimedOut"]


def test_an_instance_on_a_node_that_is_gone_is_deleted():
    state = state_with(NodeRegistered(node=node("a")), InstanceCreated(instance=TWO_RANKS))
    assert supervise(state, {"a": 100.0}, now=100.0) == [
        InstanceDeleted(instance_id="i1", reason="node b is no longer in the cluster")]


def view(state: State, me: str, phase: str, now: float = 0.0, **local) -> WorkerView:
    runner_id = "r0" if me == "a" else "r1"
    runners = {runner_id: LocalRunner(runner_id=runner_id, instance_id="i1", phase=phase, **local)}
    return WorkerView(node_id=me, state=state, runners=runners, now=now)


def test_a_group_loads_only_when_every_rank_has_its_model():
    state = state_with(*CLUSTER, status("r0", "downloaded"), status("r1", "downloading"))
    assert plan(view(state, "a", "downloaded")) == []
    state = state_with(*CLUSTER, status("r0", "downloaded"), status("r1", "downloaded"))
    assert plan(view(state, "a", "downloaded")) == [LoadModel(runner_id="r0", model_id="m/a")]
    assert plan(view(state, "b", "spawned")) == [DownloadModel(runner_id="r1", model_id="m/a")]
    ready = view(state, "a", "downloaded")
    old = LocalRunner(runner_id="old", instance_id="gone", phase="stopping")
    # A deleted instance's runner here may still hold the ring port.
    assert plan(replace(ready, runners={**ready.runners, "old": old})) == []


def test_only_rank_0_is_given_tasks():
    task = Task(task_id="t1", instance_id="i1", model_id="m/a")
    state = state_with(*CLUSTER, status("r0", "ready"), status("r1", "ready"), TaskCreated(task=task))
    assert plan(view(state, "a", "ready")) == [ForwardTask(runner_id="r0", task_id="t1")]
    assert plan(view(state, "b", "ready")) == []


def test_a_failed_peer_stops_the_group_and_a_failed_runner_restarts_after_its_back_off():
    task = Task(task_id="t1", instance_id="i1", model_id="m/a")
    state = state_with(*CLUSTER, status("r0", "ready"), TaskCreated(task=task), status("r1", "failed", 1, "died"))
    (abandon,) = plan(view(state, "a", "ready", forwarded=frozenset({"t1"})))
    assert abandon == AbandonRunner(runner_id="r0", reason="peer runner r1 on node b failed: died")
    assert plan(view(state, "a", "downloading")) == []  # not in the group yet: nothing to break
    # The abandoned rank ends its task and restarts 1 s later; the failed one backs off by its failures.
    (end,) = plan(view(state, "a", "failed", now=0.5, failed_at=0.0, forwarded=frozenset({"t1"}), error="peer"))
    assert isinstance(end, EndTask) and end.status == "failed"
    assert plan(view(state, "b", "failed", now=0.5, failed_at=0.0, failures=1)) == []
    assert plan(view(state, "b", "failed", now=1.0, failed_at=0.0, failures=1)) == [
        RestartRunner(runner_id="r1", instance_id="i1")]
    assert restart_due(LocalRunner(runner_id="r", instance_id="i", failed_at=10.0, failures=3)) == 14.0
    assert restart_due(LocalRunner(runner_id="r", instance_id="i", failed_at=10.0, failures=9)) == 40.0
    assert plan(view(state, "b", "failed", now=99.0, failures=3)) == []  # given up: the master deletes it
    assert plan(view(state, "b", "failed", now=99.0, failures=1, restartable=False)) == []


def test_node_ids_survive_restarts_but_not_copies(tmp_path: Path):
    (tmp_path / "a").mkdir()
    first = load_node_id(tmp_path / "a")
    assert load_node_id(tmp_path / "a") == first
    copy = tmp_path / "copy"
    copy.mkdir()
    for name in ("node_id", "node_id.origin"):
        (copy / name).write_bytes((tmp_path / "a" / name).read_bytes())
    assert load_node_id(copy) != first
    legacy = tmp_path / "legacy"
    legacy.mkdir()
    (legacy / "node_id").write_text("old-id\n")
    assert load_node_id(legacy) == "old-id" and load_node_id(legacy) == "old-id"


def test_one_data_dir_one_process(tmp_path: Path):
    held = lock_data_dir(tmp_path)
    with pytest.raises(IdentityError, match="another exo process is using the data dir"):
        lock_data_dir(tmp_path)
    held.close()
    lock_data_dir(tmp_path).close()
