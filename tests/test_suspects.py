"""A node's suspect mark lives in State (exo/master/supervise.py's suspect_marks, folded by
exo/core/apply.py): the master marks a silent node once, clears it once when heard again, and a
master rebuilt from the log keeps it. Pure: heard-at times and clocks are arguments."""

from __future__ import annotations

import msgspec

from exo.core.apply import apply
from exo.core.events import AnyEvent, Event, NodeHeartbeat, NodeRegistered, NodeSuspected, decode_event, encode_event
from exo.core.ids import NodeId
from exo.core.state import State, decode_state, encode_state
from exo.core.types import NodeInfo
from exo.master.supervise import seed_heard_at, silent_nodes, suspect_marks
from tests.support.as_master import stamped, with_leader

SUSPECT_S = 5.0
STUDIO = NodeInfo(node_id=NodeId("a" * 32), name="studio")
MINI = NodeInfo(node_id=NodeId("b" * 32), name="mini")
MARKED = NodeSuspected(node_id=MINI.node_id, at=1005.0, reason="node mini is suspect: no pulse for 5 s")


def two_nodes() -> State:
    return with_leader(State(nodes={n.node_id: n for n in (STUDIO, MINI)}))


def fold(state: State, events: list[Event]) -> State:
    """As every node folds the log: each event through the wire, a master's stamped with its term."""
    for event in events:
        wired = decode_event(encode_event(stamped(state, event)))  # type: ignore[arg-type]  # every Event is an AnyEvent
        state = apply(state, wired, state.last_seq + 1)
    return state


def round_at(state: State, heard_at: dict[NodeId, float], now: float, may_mark: bool = True) -> list[Event]:
    """One supervision round, as Master._supervise runs it (its wall clock is 1000 s ahead here)."""
    return suspect_marks(state, silent_nodes(state, heard_at, now, SUSPECT_S), 1000.0 + now, SUSPECT_S,
                         may_mark=may_mark)


def test_a_silent_node_is_marked_once_and_cleared_once_when_heard_again():
    state, heard = two_nodes(), {STUDIO.node_id: 0.0, MINI.node_id: 0.0}
    assert round_at(state, heard, 4.0) == []
    heard[STUDIO.node_id] = 4.0
    assert round_at(state, heard, 5.0) == [MARKED]
    state = fold(state, [MARKED])
    assert state.nodes[MINI.node_id].suspect_since == 1005.0 and state.nodes[STUDIO.node_id].suspect_since == 0.0
    heard[STUDIO.node_id] = 8.0
    assert round_at(state, heard, 6.0) == round_at(state, heard, 9.0) == []  # still silent: no more events
    heard[MINI.node_id] = 9.5
    back = NodeSuspected(node_id=MINI.node_id, suspect=False, at=1010.0, reason="node mini is heard again")
    assert round_at(state, heard, 10.0) == [back]
    state = fold(state, [back])
    assert state.nodes[MINI.node_id].suspect_since == 0.0
    assert round_at(state, heard, 11.0) == []


def test_silence_that_proves_nothing_marks_no_node_but_a_node_heard_is_cleared():
    state = fold(two_nodes(), [MARKED])
    heard = {STUDIO.node_id: 0.0, MINI.node_id: 9.0}
    assert round_at(state, heard, 10.0, may_mark=False) == [
        NodeSuspected(node_id=MINI.node_id, suspect=False, at=1010.0, reason="node mini is heard again")]


def test_a_nodes_own_description_neither_sets_nor_clears_the_mark():
    state = fold(two_nodes(), [MARKED, NodeHeartbeat(node=msgspec.structs.replace(MINI, memory_total=7))])
    assert (state.nodes[MINI.node_id].memory_total, state.nodes[MINI.node_id].suspect_since) == (7, 1005.0)
    forged = msgspec.structs.replace(STUDIO, suspect_since=3.0)
    state = fold(state, [NodeRegistered(node=forged)])
    assert state.nodes[STUDIO.node_id].suspect_since == 0.0


def test_the_reducer_skips_a_mark_that_changes_nothing():
    state = fold(two_nodes(), [MARKED])
    for event, why in [(MARKED, "is already suspect"),
                       (NodeSuspected(node_id=STUDIO.node_id, suspect=False), "is not suspect"),
                       (NodeSuspected(node_id=STUDIO.node_id), "marked suspect without the time"),
                       (NodeSuspected(node_id=NodeId("c" * 32), at=1.0), "unknown node")]:
        after = fold(state, [event])
        assert after.nodes == state.nodes and why in after.skipped_events[-1].reason


def test_a_new_master_rebuilt_from_the_log_keeps_the_mark():
    log: list[AnyEvent] = [NodeRegistered(node=STUDIO), NodeRegistered(node=MINI), MARKED]
    rebuilt = decode_state(encode_state(fold(with_leader(), log)))  # replayed, then through a snapshot
    assert rebuilt.nodes[MINI.node_id].suspect_since == 1005.0
    heard: dict[NodeId, float] = {}  # the new master has heard no one yet
    seed_heard_at(rebuilt, heard, 50.0, SUSPECT_S)
    assert round_at(rebuilt, heard, 50.0) == []  # no "back" for a node nobody heard
    heard[MINI.node_id] = 51.0
    assert round_at(rebuilt, heard, 52.0) == [
        NodeSuspected(node_id=MINI.node_id, suspect=False, at=1052.0, reason="node mini is heard again")]


def test_an_old_node_info_without_the_mark_decodes_unmarked():
    old = b'{"kind": "node.registered", "node": {"node_id": "' + b"b" * 32 + b'", "name": "mini"}}'
    event = decode_event(old)
    assert isinstance(event, NodeRegistered) and event.node == MINI and event.node.suspect_since == 0.0
