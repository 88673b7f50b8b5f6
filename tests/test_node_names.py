"""What people call a node (exo/core/node_names.py), and the master's reasons and log lines that
use it: the node's name, its short id added only where two nodes in State share that name."""

from __future__ import annotations

import logging

import pytest

from exo.core.apply import apply
from exo.core.events import NodeTimedOut
from exo.core.ids import NodeId
from exo.core.node_names import node_display
from exo.core.state import State
from exo.core.types import NodeInfo
from exo.master.lifecycle_log import LifecycleLog
from exo.master.supervise import time_out_node
from tests.support.as_master import stamped, with_leader

STUDIO = NodeInfo(node_id=NodeId("3f2a91c0" + "a" * 24), name="studio")
TWIN = NodeInfo(node_id=NodeId("77b0c1d2" + "b" * 24), name="studio")
MINI = NodeInfo(node_id=NodeId("c" * 32), name="", hostname="mini.local")
BARE = NodeInfo(node_id=NodeId("d" * 32))


def state_of(*nodes: NodeInfo) -> State:
    return State(nodes={n.node_id: n for n in nodes})


def test_a_node_goes_by_its_name_else_its_hostname():
    state = state_of(STUDIO, MINI)
    assert (node_display(state, STUDIO.node_id), node_display(state, MINI.node_id)) == ("studio", "mini.local")


def test_two_nodes_of_one_name_get_their_short_ids():
    state = state_of(STUDIO, TWIN, MINI)
    assert [node_display(state, n.node_id) for n in (STUDIO, TWIN, MINI)] == [
        "studio (3f2a91c0)", "studio (77b0c1d2)", "mini.local"]


def test_a_node_without_a_name_or_not_in_state_goes_by_its_short_id():
    state = state_of(STUDIO, BARE)
    assert (node_display(state, BARE.node_id), node_display(state, TWIN.node_id)) == ("dddddddd", "77b0c1d2")


def test_a_timed_out_twin_is_named_apart_in_state_and_in_the_log(caplog: pytest.LogCaptureFixture):
    state = with_leader(state_of(STUDIO, TWIN))
    (timed_out,) = time_out_node(state, TWIN.node_id, 30.0)
    assert timed_out == NodeTimedOut(node_id=TWIN.node_id, reason="node studio (77b0c1d2) timed out: no heartbeat for 30 s")
    log = LifecycleLog(state, lambda: True)
    event = stamped(state, timed_out)
    with caplog.at_level(logging.INFO, logger="exo.master.service"):
        log.on_event(state.last_seq + 1, event, apply(state, event, state.last_seq + 1))
    assert caplog.messages == ["master: node studio (77b0c1d2) gone: timed out: no heartbeat for 30 s"]
