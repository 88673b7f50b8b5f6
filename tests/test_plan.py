"""The worker's planner on plain data: lifecycle order, task forwarding, cancels, failures."""

import msgspec

from exo.core.apply import apply
from exo.core.events import (
    InstanceCreated,
    InstanceDeleted,
    LeaderElected,
    NodeRegistered,
    NodeTimedOut,
    RunnerStatusChanged,
    TaskCancelRequested,
    TaskCreated,
    TaskFinished,
    TaskStarted,
)
from exo.core.state import State
from exo.core.types import Instance, Migration, NodeInfo, ShardAssignment, Task
from exo.worker.plan import (
    CancelForwardedTask,
    CreateRunner,
    DownloadModel,
    EndTask,
    ForwardTask,
    LoadModel,
    LocalRunner,
    StopRunner,
    WarmUpRunner,
    WorkerView,
    busy,
    nodes_concerned,
    plan,
    settled,
)
from tests.support.as_master import stamped, with_leader

MINE = Instance(instance_id="i1", model_id="m/a", shards=[ShardAssignment(runner_id="r1", node_id="me", end_layer=2)])
THEIRS = Instance(instance_id="i2", model_id="m/a", shards=[ShardAssignment(runner_id="r2", node_id="other")])


def state_with(*events) -> State:
    state = with_leader()
    for event in events:
        state = apply(state, stamped(state, event), state.last_seq + 1)
    return state


def view(state: State, phase: str | None = None, **local) -> WorkerView:
    runners = {} if phase is None else {"r1": LocalRunner(runner_id="r1", instance_id="i1", phase=phase, **local)}
    return WorkerView(node_id="me", state=state, runners=runners)


def test_lifecycle_runs_create_download_load_warm_up_in_order():
    state = state_with(InstanceCreated(instance=MINE), InstanceCreated(instance=THEIRS))
    assert plan(view(state)) == [CreateRunner(runner_id="r1", instance_id="i1")]
    assert plan(view(state, "spawned")) == [DownloadModel(runner_id="r1", model_id="m/a")]
    assert plan(view(state, "downloaded")) == [LoadModel(runner_id="r1", model_id="m/a")]
    assert plan(view(state, "loaded")) == [WarmUpRunner(runner_id="r1")]
    for phase in ("spawning", "downloading", "loading", "warming_up", "ready"):
        assert plan(view(state, phase)) == []


def test_tasks_wait_for_a_ready_runner_then_are_forwarded_once():
    task = Task(task_id="t1", instance_id="i1", model_id="m/a")
    state = state_with(InstanceCreated(instance=MINE), TaskCreated(task=task))
    assert plan(view(state, "loading")) == []
    assert plan(view(state, "ready")) == [ForwardTask(runner_id="r1", task_id="t1")]
    assert plan(view(state, "ready", forwarded=frozenset({"t1"}))) == []
    # Nor one State still calls pending, that the runners of this worker's earlier life were given.
    pending = state_with(InstanceCreated(instance=MINE), TaskCreated(task=task))
    assert isinstance(plan(view(pending, "ready"))[0], ForwardTask)
    restarted = msgspec.structs.replace(view(pending, "ready"), given_before_restart={"t1": 0})
    (end,) = plan(restarted)
    assert isinstance(end, EndTask) and end.status == "failed" and end.reason == "its runner restarted mid-generation"
    # A task moved since (a later run, back on this node) was not begun here: it is forwarded.
    moved = state_with(InstanceCreated(instance=MINE), TaskCreated(task=msgspec.structs.replace(
        task, migrations=[Migration(from_instance="i0", to_instance="i1")])))
    assert isinstance(plan(msgspec.structs.replace(view(moved, "ready"), given_before_restart={"t1": 0}))[0], ForwardTask)


def test_cancel_before_and_after_forwarding():
    task = Task(task_id="t1", instance_id="i1", model_id="m/a")
    state = state_with(InstanceCreated(instance=MINE), TaskCreated(task=task), TaskCancelRequested(task_id="t1"))
    (end,) = plan(view(state, "loading"))
    assert isinstance(end, EndTask) and end.status == "cancelled"
    assert plan(view(state, "ready", forwarded=frozenset({"t1"}))) == [CancelForwardedTask(runner_id="r1", task_id="t1")]
    assert plan(view(state, "ready", forwarded=frozenset({"t1"}), cancels_sent=frozenset({"t1"}))) == []


def test_a_failed_runner_ends_its_tasks_once():
    task = Task(task_id="t1", instance_id="i1", model_id="m/a")
    state = state_with(InstanceCreated(instance=MINE), TaskCreated(task=task))
    (end,) = plan(view(state, "failed", forwarded=frozenset({"t1"})))
    assert isinstance(end, EndTask) and end.status == "failed"
    failed = view(state, "failed")
    assert plan(WorkerView(node_id="me", state=state, runners=failed.runners, ended_tasks=frozenset({"t1"}))) == []


def test_runners_of_deleted_instances_are_stopped():
    assert plan(view(State(), "ready")) == [StopRunner(runner_id="r1")]
    assert plan(view(State(), "stopping")) == []


def test_a_task_left_running_by_a_runner_before_a_restart_is_failed_not_rerun():
    from exo.core.events import TaskStarted

    task = Task(task_id="t1", instance_id="i1", model_id="m/a")
    state = state_with(InstanceCreated(instance=MINE), TaskCreated(task=task), TaskStarted(task_id="t1"))
    (end,) = plan(view(state, "ready"))
    assert isinstance(end, EndTask) and end.status == "failed"
    assert plan(view(state, "ready", forwarded=frozenset({"t1"}))) == []


def test_a_task_is_forwarded_only_once_its_images_are_on_this_node():
    from exo.core.requests import ChatMessage, GenerationParams
    from exo.worker.plan import FetchImages

    params = GenerationParams(messages=[ChatMessage(role="user", content="look", images=["aa", "bb"])])
    task = Task(task_id="t1", instance_id="i1", model_id="m/a", params=params)
    state = state_with(InstanceCreated(instance=MINE), TaskCreated(task=task))
    ready = view(state, "ready")
    assert plan(ready) == [FetchImages(digests=["aa", "bb"])]
    fetching = WorkerView(node_id="me", state=state, runners=ready.runners, images_in_flight=frozenset({"aa"}),
                          local_images=frozenset({"bb"}))
    assert plan(fetching) == []
    fetched = WorkerView(node_id="me", state=state, runners=ready.runners, local_images=frozenset({"aa", "bb"}))
    assert plan(fetched) == [ForwardTask(runner_id="r1", task_id="t1")]
    loading = WorkerView(node_id="me", state=state, runners=view(state, "loading").runners)
    assert plan(loading) == [FetchImages(digests=["aa", "bb"])]  # fetched while the model loads


def test_a_runner_with_work_that_goes_silent_is_killed_as_hung():
    from exo.worker.plan import KillHungRunner

    task = Task(task_id="t1", instance_id="i1", model_id="m/a")
    state = state_with(InstanceCreated(instance=MINE), TaskCreated(task=task))

    def at(now: float, **local) -> list:
        runners = {"r1": LocalRunner(runner_id="r1", instance_id="i1", phase="ready", heard_at=100.0, **local)}
        return plan(WorkerView(node_id="me", state=state, runners=runners, now=now, stall_after=30.0))

    assert at(129.0, forwarded=frozenset({"t1"})) == []  # heard from recently
    (kill,) = at(131.0, forwarded=frozenset({"t1"}))
    assert kill == KillHungRunner(runner_id="r1", reason="no progress for 31 s while generating")
    assert at(500.0) == [ForwardTask(runner_id="r1", task_id="t1")]  # no work yet: silence is not a hang


def test_ended_tasks_are_forgotten_once_state_has_their_end_and_not_before():
    running = [Task(task_id=t, instance_id="i1", model_id="m/a") for t in ("t1", "t2", "t3")]
    state = state_with(InstanceCreated(instance=MINE), *(TaskCreated(task=t) for t in running),
                       TaskStarted(task_id="t2"), TaskFinished(task_id="t1", status="completed", finish_reason="stop"))
    # t1: its end is in State; t2: this node ended it but State has not folded that yet; t9: gone from State.
    assert settled(state, {"t1", "t2", "t9"}) == {"t1", "t9"}
    # What stays keeps the runner busy and the task from being forwarded again.
    local = view(state, "ready", forwarded=frozenset({"t2", "t3"}))
    local = WorkerView(node_id="me", state=state, runners=local.runners, ended_tasks=frozenset({"t2"}))
    assert busy(local, local.runners["r1"]) and plan(local) == []


def test_only_the_nodes_an_instance_runs_on_plan_again_for_its_task_and_runner_events():
    """A worker wakes for its own instances' traffic, not the whole cluster's (exo/worker/service.py)."""
    state = state_with(InstanceCreated(instance=MINE), InstanceCreated(instance=THEIRS))
    created = TaskCreated(task=Task(task_id="t1", instance_id="i2", model_id="m/a"))
    state = apply(state, stamped(state, created), state.last_seq + 1)
    assert nodes_concerned(state, created) == {"other"}
    for event in (TaskStarted(task_id="t1"), TaskCancelRequested(task_id="t1"), TaskFinished(task_id="t1", status="completed")):
        state = apply(state, stamped(state, event), state.last_seq + 1)
        assert nodes_concerned(state, event) == {"other"}
    status = RunnerStatusChanged(runner_id="r1", instance_id="i1", node_id="me", status="ready")
    assert nodes_concerned(state, status) == {"me"}
    assert nodes_concerned(state, NodeTimedOut(node_id="other")) == {"other"}
    # What cannot be pinned to nodes wakes every node: instances come and go, unknown tasks, elections.
    deleted = InstanceDeleted(instance_id="i2")
    after = apply(state, stamped(state, deleted), state.last_seq + 1)
    assert nodes_concerned(after, deleted) is None
    assert nodes_concerned(after, TaskFinished(task_id="t1", status="completed")) is None  # its instance is gone
    assert nodes_concerned(state, TaskStarted(task_id="unknown")) is None
    assert nodes_concerned(state, LeaderElected(node_id="x")) is None


def test_a_failed_runner_is_restarted_below_the_limit_and_left_to_the_master_at_it():
    """The worker's restart limit and the master's deletion bound are one number: below it the
    worker restarts a failed runner (once its back-off is over) and the master keeps the instance;
    at it the worker never restarts it again and the master deletes the instance. End to end only
    the deletion shows (tests/test_runner_lifecycle.py): the worker's own limit is checked here."""
    from exo.master.supervise import DEFAULT_MAX_RUNNER_FAILURES, supervise
    from exo.worker.plan import RestartRunner, restart_due

    state = state_with(InstanceCreated(instance=MINE))
    limit = WorkerView(node_id="me", state=state).max_failures  # the worker's default, as exo runs it
    assert limit == DEFAULT_MAX_RUNNER_FAILURES, (limit, DEFAULT_MAX_RUNNER_FAILURES)
    for failures in range(1, limit + 1):
        failed = LocalRunner(runner_id="r1", instance_id="i1", phase="failed", failures=failures, failed_at=100.0)

        def at(now: float, failed: LocalRunner = failed) -> list:
            return plan(WorkerView(node_id="me", state=state, runners={"r1": failed}, now=now))

        due = restart_due(failed)
        assert due > 100.0 and at(due - 0.01) == [], failures  # backing off
        restarts = at(due) == [RestartRunner(runner_id="r1", instance_id="i1")]
        assert restarts or at(due + 3600.0) == [], failures  # not restarted now: nor ever
        reported = state_with(NodeRegistered(node=NodeInfo(node_id="me")), InstanceCreated(instance=MINE),
                              RunnerStatusChanged(runner_id="r1", instance_id="i1", node_id="me", status="failed",
                                                  error="boom", failures=failures))
        deletes = any(isinstance(e, InstanceDeleted) and e.instance_id == "i1" and f"failed {failures} times" in e.reason
                      for e in supervise(reported, {}, 0.0))  # the master as exo runs it: its default bound
        assert (restarts, deletes) == (failures < limit, failures >= limit), \
            f"after {failures} failures (worker's limit {limit}): worker restarts {restarts}, master deletes {deletes}"
