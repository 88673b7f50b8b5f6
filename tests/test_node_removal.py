"""`exo node remove` on plain data (exo/master/removal.py, exo/core/revocation.py): the node's
instances end as a timed-out node's do (their generations move), it leaves State for good with
its key on record (bounded), and what it says of itself afterwards is ignored."""

from __future__ import annotations

import itertools

import pytest

from exo.core import revocation
from exo.core.apply import apply, was_skipped
from exo.core.chunk_signers import run_signers
from exo.core.commands import GenerateText, PlaceInstance, RemoveNode
from exo.core.events import (
    CommandRejected,
    DownloadProgressed,
    InstanceDeleted,
    NodeHeartbeat,
    NodeRegistered,
    NodeRemoved,
    RunnerStatusChanged,
    TaskFinished,
    TaskMigrated,
    TaskStarted,
)
from exo.core.revocation import find_nodes
from exo.core.state import RevokedNode, State
from exo.core.types import DownloadProgress, ModelCard, NodeInfo
from exo.master.decide import decide
from exo.master.heal import HealLimits
from exo.master.supervise import supervise
from tests.support.as_master import stamped, with_leader

CARD = ModelCard(model_id="org/m", n_layers=8, storage_bytes=1000)
BUILTIN = {"org/m": CARD}
LIMITS = HealLimits(suspect_s=5, deadline_s=120, max_migrations=2)


def node(node_id: str, key: str = "") -> NodeInfo:
    return NodeInfo(node_id=node_id, name=f"host-{node_id}", memory_available=10_000, public_key=key or f"key-{node_id}")


def fold(state: State, events) -> State:
    for event in events:
        state = apply(state, stamped(state, event), state.last_seq + 1)
    return state


def command(state: State, cmd) -> tuple[State, list]:
    events = decide(state, cmd, builtin_cards=BUILTIN, ids=(f"{cmd.command_id}-{n}" for n in itertools.count()),
                    heal=LIMITS)
    return fold(state, events), events


def serving_on_two_nodes() -> tuple[State, str, str]:
    """Nodes a and b, a replica on each, task t1 running: (state, the node running t1, the other)."""
    state = fold(with_leader(), [NodeRegistered(node=node("a")), NodeRegistered(node=node("b"))])
    state, _ = command(state, PlaceInstance(command_id="p", model_id="org/m", replicas=2))
    state, _ = command(state, GenerateText(command_id="t1", model_id="org/m", at=1000.0))
    state = fold(state, [TaskStarted(task_id="t1")])
    victim = state.instances[state.tasks["t1"].instance_id].shards[0].node_id
    return state, victim, "b" if victim == "a" else "a"


def remove(state: State, node_id: str) -> tuple[State, list]:
    return command(state, RemoveNode(command_id="r", node_id=node_id, reason="laptop stolen", removed_by="API key k1",
                                     at=2000.0))


def test_removal_ends_its_instances_moves_their_tasks_and_records_its_key():
    state, victim, other = serving_on_two_nodes()
    doomed = state.tasks["t1"].instance_id
    state, events = remove(state, victim)
    assert [type(e) for e in events] == [TaskMigrated, InstanceDeleted, NodeRemoved]
    reason = f"node host-{victim} was removed by API key k1: laptop stolen"
    assert events[1] == InstanceDeleted(instance_id=doomed, reason=reason)
    assert events[2] == NodeRemoved(command_id="r", node_id=victim, public_key=f"key-{victim}", reason="laptop stolen",
                                    removed_by="API key k1")
    task = state.tasks["t1"]
    assert task.status == "pending" and task.migrations[0].from_instance == doomed and task.migrations[0].at == 2000.0
    assert state.instances[task.instance_id].shards[0].node_id == other and reason in task.migrations[0].reason
    assert set(state.nodes) == {other} and doomed not in state.instances
    assert not any(r.node_id == victim for r in state.runners.values())
    assert state.revoked_nodes == {victim: RevokedNode(public_key=f"key-{victim}", seq=state.last_seq,
                                                       reason="laptop stolen", removed_by="API key k1")}
    assert state.answered_commands["r"] == state.last_seq  # the API's answer: the whole removal is in State
    # The master treats it as gone at once: the desire's replacement goes to the node left, though
    # the removed one was heard from a moment ago.
    heard = {victim: 2000.0, other: 2000.0}
    replaced = supervise(state, heard, 2000.5, node_timeout=30, wall_now=2000.5, limits=LIMITS, builtin=BUILTIN,
                         ids=(f"h{n}" for n in itertools.count()))
    state = fold(state, replaced)
    assert len(state.instances) == 2 and {i.shards[0].node_id for i in state.instances.values()} == {other}


def test_what_a_removed_node_says_afterwards_is_ignored():
    state, victim, _ = serving_on_two_nodes()
    runner = next(r for r in state.runners.values() if r.node_id == victim)
    state, _ = remove(state, victim)
    later = [
        NodeHeartbeat(node=node(victim)),
        NodeRegistered(node=node(victim, key="another-key")),
        RunnerStatusChanged(runner_id=runner.runner_id, instance_id=runner.instance_id, node_id=victim, status="ready"),
        DownloadProgressed(progress=DownloadProgress(node_id=victim, model_id="org/m", status="completed")),
        TaskStarted(task_id="t1", attempt=0),  # its runner, on the run the task moved on from
        TaskFinished(task_id="t1", status="completed", finish_reason="stop", attempt=0),
        NodeRegistered(node=node("c", key=f"key-{victim}")),  # its key under a new node id
    ]
    for event in later:
        before = state
        state = apply(state, event, state.last_seq + 1)
        assert was_skipped(state, state.last_seq), event
        assert (state.nodes, state.runners, state.tasks, state.downloads) == (
            before.nodes, before.runners, before.tasks, before.downloads), event
    assert victim not in state.nodes and state.tasks["t1"].status == "pending"
    # A new node id with a key of its own joins (the shared credential allows it: docs/deploy.md).
    state = apply(state, NodeRegistered(node=node("c")), state.last_seq + 1)
    assert "c" in state.nodes


def test_an_unknown_or_removed_node_is_refused_and_a_removal_without_the_term_is_skipped():
    state, victim, _ = serving_on_two_nodes()
    _, events = command(state, RemoveNode(command_id="r0", node_id="nobody"))
    assert events == [CommandRejected(command_id="r0", command_kind="remove_node", code="not_found",
                                      reason="unknown node 'nobody'")]
    stray = apply(state, NodeRemoved(node_id=victim), state.last_seq + 1)  # no term: not the master's
    assert was_skipped(stray, stray.last_seq) and victim in stray.nodes and not stray.revoked_nodes
    state, _ = remove(state, victim)
    _, events = command(state, RemoveNode(command_id="r2", node_id=victim))
    assert events == [CommandRejected(command_id="r2", command_kind="remove_node", code="not_found",
                                      reason=f"node {victim} was removed already (event {state.last_seq})")]


def test_the_record_of_removed_nodes_is_bounded_oldest_out(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(revocation, "MAX_REVOKED_NODES", 2)
    state = fold(with_leader(), [NodeRegistered(node=node(n)) for n in "xyz"])
    for n in "xyz":
        state = fold(state, [NodeRemoved(node_id=n, public_key=f"key-{n}")])
    assert list(state.revoked_nodes) == ["y", "z"] and not state.nodes


def test_a_removed_nodes_key_verifies_only_the_runs_it_ran_before_its_removal():
    state, victim, other = serving_on_two_nodes()
    state, _ = remove(state, victim)
    assert run_signers(state, "t1", 0) == {victim: f"key-{victim}"}  # a resume reads them
    assert run_signers(state, "t1", 1) == {other: f"key-{other}"}


def test_a_node_is_named_by_its_id_its_name_or_its_short_id():
    ids = ["0123456789abcdef", "0123456799999999", "fedcba9876543210"]
    state = fold(with_leader(), [NodeRegistered(node=node(ids[0])), NodeRegistered(node=node(ids[1])),
                                 NodeRegistered(node=NodeInfo(node_id=ids[2], name=f"host-{ids[0]}"))])
    assert find_nodes(state, ids[1]) == [ids[1]]
    assert find_nodes(state, f"host-{ids[1]}") == [ids[1]]
    assert find_nodes(state, f"host-{ids[0]}") == sorted([ids[0], ids[2]])  # two go by it: ambiguous
    assert find_nodes(state, "fedcba98") == [ids[2]] and find_nodes(state, "01234567") == ids[:2]
    assert find_nodes(state, "fedc") == [] and find_nodes(state, "nobody") == []
