"""Master groups, the pure part (exo/core/groups.py, exo/master/group.py): the map, the split of
State between the shared log and a group's, and a group master's own decisions."""

from __future__ import annotations

import pytest
from msgspec.structs import replace

from exo.core.apply import apply, was_skipped
from exo.core.commands import CancelTask, DeleteKey, GenerateText
from exo.core.events import (
    CommandRejected,
    GroupsSet,
    InstanceCreated,
    InstanceDeleted,
    KeySet,
    LeaderElected,
    TaskCreated,
    TaskFinished,
    TaskMigrated,
)
from exo.core.groups import for_cluster, for_group, group_of, groups_ranked_on, parse_groups
from exo.core.ids import CommandId, InstanceId, ModelId, NodeId, RunnerId, TaskId
from exo.core.keys import ApiKey
from exo.core.state import State
from exo.core.types import Desire, Instance, ShardAssignment, Task
from exo.core.usage import UsageCounts
from exo.master.group import groups_to_set, heal_group, key_copy, not_for_group
from exo.master.heal import HealLimits

KEY = "key_0123456789abcdef"


def test_the_map_parses_strictly_and_the_first_matching_group_wins() -> None:
    groups = parse_groups(" chat=org/*|meta/* , code=*coder*,")
    assert groups == {"chat": ["org/*", "meta/*"], "code": ["*coder*"]}
    assert group_of("org/llama", groups) == "chat"
    assert group_of("org/qwen-coder", groups) == "chat"  # both match: the first named
    assert group_of("x/qwen-coder", groups) == "code"
    assert group_of("x/other", groups) == ""  # the shared master's, as before groups
    assert parse_groups("") == {}
    for bad in ("chat", "Chat=a", "a.b=x", "chat=", "chat=a,chat=b", "x" * 40 + "=a", "a=" + "b" * 201):
        with pytest.raises(ValueError):
            parse_groups(bad)


def elected(state: State, term_seq: int) -> State:
    return apply(state, LeaderElected(node_id="n", lease_revision=1), term_seq)


def test_the_reducer_keeps_the_map_and_every_group_ever_named() -> None:
    state = elected(State(), 1)
    state = apply(state, GroupsSet(term=1, groups={"a": ["x/*"], "b": ["y/*"]}), 2)
    state = apply(state, GroupsSet(term=1, groups={"b": ["x/*", "y/*"]}), 3)  # a's model moves to b
    assert state.groups == {"b": ["x/*", "y/*"]} and state.group_logs == ["a", "b"]
    forged = apply(state, GroupsSet(term=1, groups={"Bad Name": ["x"]}), 4)
    assert was_skipped(forged, 4) and forged.groups == state.groups
    unsigned = apply(state, GroupsSet(groups={"c": ["z"]}), 4)  # no term: not a master's
    assert was_skipped(unsigned, 4)


def test_a_groups_log_holds_requests_only() -> None:
    group = elected(State(group="a"), 1)
    instance = Instance(instance_id=InstanceId("i"), model_id=ModelId("x/m"),
                        shards=[ShardAssignment(node_id=NodeId("n"), runner_id=RunnerId("r"))])
    for n, foreign in enumerate([InstanceCreated(term=1, instance=instance), GroupsSet(term=1, groups={"b": ["y"]}),
                                 InstanceDeleted(term=1, instance_id=InstanceId("i"))], start=2):
        folded = apply(group, foreign, n)
        assert was_skipped(folded, n) and "holds requests only" in folded.skipped_events[-1].reason
    task = Task(task_id=TaskId("t"), model_id=ModelId("x/m"), instance_id=InstanceId("i"), created_at=1.0)
    group = apply(group, TaskCreated(term=1, task=task), 5)
    # A move to an instance the group's log cannot see is its master's to check (in the shared log).
    group = apply(group, TaskMigrated(term=1, task_id=TaskId("t"), to_instance=InstanceId("j"), reason="r", at=2.0), 6)
    assert not was_skipped(group, 6) and group.tasks[TaskId("t")].instance_id == "j"


def test_views_lay_the_groups_requests_over_the_shared_state() -> None:
    shared = replace(State(last_seq=40), api_keys={KEY: ApiKey(key_id=KEY, secret_sha256="a" * 64)})
    a1 = Task(task_id=TaskId("a1"), instance_id=InstanceId("i"), model_id=ModelId("x"))
    b1 = Task(task_id=TaskId("b1"), instance_id=InstanceId("i"), model_id=ModelId("y"))
    alpha = State(group="alpha", last_seq=7, tasks={a1.task_id: a1},
                  usage_totals={KEY: {"x": UsageCounts(requests=2)}})
    beta = State(group="beta", last_seq=3, tasks={b1.task_id: b1},
                 usage_totals={KEY: {"x": UsageCounts(requests=1)}})
    decided_on = for_group(shared, alpha)
    assert decided_on.tasks is alpha.tasks and decided_on.api_keys is shared.api_keys
    assert decided_on.last_seq == 7 and decided_on.group == "alpha"
    cluster = for_cluster(shared, [alpha, beta], source=beta)
    assert set(cluster.tasks) == {"a1", "b1"} and cluster.last_seq == 3
    assert cluster.usage_totals == {KEY: {"x": UsageCounts(requests=3)}}
    assert for_cluster(shared, []) is shared
    alone = for_cluster(shared, [alpha, State(group="beta")])
    assert alone.tasks is alpha.tasks  # one log with requests: nothing copied


def test_a_group_master_decides_requests_and_copies_the_keys_it_counts() -> None:
    state = State(group="alpha")
    assert not not_for_group(state, GenerateText(command_id=CommandId("c"), model_id=ModelId("x")))
    assert not not_for_group(state, CancelTask(command_id=CommandId("c"), task_id=TaskId("t")))
    refused = not_for_group(state, DeleteKey(command_id=CommandId("d"), key_id=KEY))
    assert isinstance(refused[0], CommandRejected) and "shared master" in refused[0].reason
    key = ApiKey(key_id=KEY, secret_sha256="a" * 64)
    copied: dict[str, ApiKey] = {}
    request = GenerateText(command_id=CommandId("c"), model_id=ModelId("x"), key_id=KEY)
    assert key_copy({KEY: key}, copied, request) == [KeySet(key=key)]
    assert key_copy({KEY: key}, copied, request) == []  # copied already
    changed = replace(key, name="renamed")
    assert key_copy({KEY: changed}, copied, request) == [KeySet(key=changed)]
    assert groups_to_set({"a": ["x"]}, State(groups={"a": ["x"]})) == []
    assert groups_to_set({"a": ["y"]}, State(groups={"a": ["x"]})) == [GroupsSet(groups={"a": ["y"]})]


def test_a_groups_requests_move_when_the_shared_master_ends_their_instance() -> None:
    def instance(iid: str) -> Instance:
        return Instance(instance_id=InstanceId(iid), model_id=ModelId("x"),
                        shards=[ShardAssignment(node_id=NodeId("n"), runner_id=RunnerId(f"r{iid}"))])

    def task(tid: str, on: str, **extra) -> Task:
        return Task(task_id=TaskId(tid), model_id=ModelId("x"), instance_id=InstanceId(on), created_at=1.0, **extra)

    live = {InstanceId("live"): instance("live")}
    tasks = {t.task_id: t for t in [task("moves", "gone"), task("stays", "live"),
                                    task("cancelled", "gone", cancel_requested=True), task("done", "gone", status="completed")]}
    state = State(group="alpha", instances=live, tasks=tasks, instance_end_reasons={ModelId("x"): "node n timed out"})
    events = heal_group(state, now=5.0, limits=HealLimits())
    assert events == [
        TaskMigrated(task_id=TaskId("moves"), to_instance=InstanceId("live"), reason="instance gone: node n timed out", at=5.0),
        TaskFinished(task_id=TaskId("cancelled"), status="cancelled", finish_reason="cancelled",
                     error="instance deleted: node n timed out"),
    ]
    assert heal_group(state, now=2.0, limits=HealLimits()) == []  # 1 s old: the shared view may lag a new master's
    # No instance left: a request waits for its desire's replacement, or ends without one.
    bare = replace(state, instances={}, tasks={TaskId("moves"): tasks[TaskId("moves")]})
    assert heal_group(bare, 5.0, HealLimits()) == [TaskFinished(task_id=TaskId("moves"), status="failed",
                                                                finish_reason="error",
                                                                error="instance deleted: node n timed out")]
    desired = replace(bare, desires={"d": Desire(desire_id="d", model_id=ModelId("x"))})
    assert heal_group(desired, 5.0, HealLimits()) == [TaskMigrated(task_id=TaskId("moves"), to_instance=InstanceId(""),
                                                                   reason="instance gone: node n timed out", at=5.0)]


def test_a_worker_only_node_wants_the_groups_of_its_ranks() -> None:
    def instance(iid: str, model: str, *nodes: str) -> Instance:
        return Instance(instance_id=InstanceId(iid), model_id=ModelId(model),
                        shards=[ShardAssignment(node_id=NodeId(n), runner_id=RunnerId(f"{iid}-{n}")) for n in nodes])

    state = State(groups={"chat": ["org/*"], "code": ["*coder*"]},
                  instances={i.instance_id: i for i in [instance("a", "org/llama", "n1", "n2"), instance("b", "x/coder", "n2"),
                                                        instance("c", "x/other", "n1")]})
    assert groups_ranked_on(state, "n1") == {"chat"}  # x/other is the shared master's
    assert groups_ranked_on(state, "n2") == {"chat", "code"}
    assert groups_ranked_on(state, "n3") == set()


def test_a_bad_group_map_stops_the_node_before_it_starts(capsys) -> None:
    from exo.main import parse_args

    with pytest.raises(SystemExit) as stopped:
        parse_args([], environ={"EXO_MASTER_GROUPS": "chat=org/*,Chat Two=x"})
    assert stopped.value.code == 2
    assert "EXO_MASTER_GROUPS (--master-groups): master group 'Chat Two'" in capsys.readouterr().err
    assert parse_args([], environ={"EXO_MASTER_GROUPS": "chat=org/*"}).master.groups == "chat=org/*"


def test_the_live_union_equals_a_union_made_afresh_after_every_event() -> None:
    """ClusterView patches one union of every log's tasks and answered commands per event; past
    1,000 finished tasks and 1,024 answered commands per log, the oldest leave it as they leave State."""
    import random

    from exo.core.groups import LiveUnion
    from exo.core.state import MAX_ANSWERED_COMMANDS, MAX_FINISHED_TASKS

    rng = random.Random(7)
    logs = {"": elected(State(), 1), "a": elected(State(group="a"), 1)}
    union = LiveUnion()
    for state in logs.values():
        union.add_log(state)
    open_tasks: dict[str, list[str]] = {name: [] for name in logs}
    for n in range(5 * MAX_FINISHED_TASKS):
        name = rng.choice(list(logs))
        before = logs[name]
        if open_tasks[name] and rng.random() < 0.5:
            event = TaskFinished(task_id=TaskId(open_tasks[name].pop(rng.randrange(len(open_tasks[name])))),
                                 status="completed")
        elif rng.random() < 0.05:  # one the reducer skips: nothing changes
            event = TaskFinished(task_id=TaskId("no-such-task"), status="completed")
        else:
            task_id = f"{name}-t{n}"
            open_tasks[name].append(task_id)
            event = TaskCreated(term=1, command_id=CommandId(task_id),
                                task=Task(task_id=TaskId(task_id), instance_id=InstanceId("i"), model_id=ModelId("x")))
        after = logs[name] = apply(before, event, before.last_seq + 1)
        union.fold(before, after, event)
        assert union.tasks == {k: v for s in logs.values() for k, v in s.tasks.items()}
        assert union.answered == {k: v for s in logs.values() for k, v in s.answered_commands.items()}
    assert max(len(s.finished_task_ids) for s in logs.values()) == MAX_FINISHED_TASKS  # evictions were exercised
    assert max(len(s.answered_commands) for s in logs.values()) == MAX_ANSWERED_COMMANDS
