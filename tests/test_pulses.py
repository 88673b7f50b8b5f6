"""Liveness off the log: nodes pulse on core NATS and describe themselves in the event log only
when something changed, so an idle cluster's log stays still; the master still times out a node
whose pulses stop, and a node State dropped describes itself again."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from msgspec.structs import replace

from exo.core.apply import apply
from exo.core.events import NodeHeartbeat, NodeTimedOut
from exo.core.ids import NodeId
from exo.core.types import NodeInfo, PromptCacheStats
from exo.worker.heartbeat import Heartbeat, worth_an_event
from tests.support.as_master import stamped, with_leader
from tests.support.cluster import NatsServer, start_node, state_of, wait_until

GB = 1_000_000_000
TOLD = NodeInfo(node_id="n", hostname="h", memory_total=100 * GB, memory_available=50 * GB, cpu_count=8,
                addresses=["10.0.0.1"], ring_port_first=5000, ring_port_count=4, incarnation="i1", last_seen=1.0)


def test_only_what_placement_or_routing_reads_is_worth_an_event():
    assert worth_an_event(None, TOLD)  # nothing said yet, or State dropped the node
    assert not worth_an_event(TOLD, replace(TOLD, last_seen=99.0))  # time alone: no event
    assert not worth_an_event(TOLD, replace(TOLD, memory_available=50 * GB - 5 * GB))  # within 5% of total
    assert worth_an_event(TOLD, replace(TOLD, memory_available=50 * GB - 5 * GB - 1))
    assert worth_an_event(TOLD, replace(TOLD, addresses=["10.0.0.2"]))
    assert worth_an_event(TOLD, replace(TOLD, prompt_caches={"i": PromptCacheStats(entries=1)}))
    assert worth_an_event(TOLD, replace(TOLD, incarnation="i2"))


async def test_a_node_describes_itself_once_while_idle_and_again_once_state_drops_it():
    appended: list = []
    pulses: list[str] = []

    async def append(event) -> None:
        appended.append(event)

    async def pulse(incarnation: str) -> None:
        pulses.append(incarnation)

    beat = Heartbeat(NodeId("n"), append, pulse)
    state = with_leader()

    def fold(event) -> None:
        nonlocal state
        state = apply(state, stamped(state, event), 1 + state.last_seq)
        beat.on_event(state.last_seq, event, state)

    await beat.beat()
    fold(appended[0])
    await beat.beat()
    await beat.beat()
    assert pulses == [beat.incarnation] * 3 and len(appended) == 1  # three pulses, one description
    fold(NodeTimedOut(node_id=NodeId("n"), reason="silent"))
    await beat.beat()
    assert len(appended) == 2 and isinstance(appended[1], NodeHeartbeat)  # back into State at its next beat
    fold(appended[1])
    await beat.beat()
    assert len(appended) == 2


@pytest.mark.slow
def test_an_idle_node_keeps_the_log_still_and_stays_alive_on_its_pulses(tmp_path: Path):
    nats = NatsServer(tmp_path / "nats")
    node = start_node(tmp_path, "node", nats.url, "--node-timeout", "1.5", env={"EXO_HEARTBEAT_S": "0.2"})
    try:
        # Start-up's events: its registration and its master's election, which "node ready" does not
        # wait for (the master campaigns beside the API's start; a loaded machine has taken over 1 s).
        wait_until(lambda: (state := state_of(node)).leader_node != "" and list(state.nodes) == [state.leader_node], 30,
                   what="the node registered and its master elected")
        time.sleep(1.0)  # a first beat sent before State held the registration has landed (a second description)
        before = state_of(node)
        time.sleep(4.0)  # 20 heartbeat intervals, well past the node timeout
        after = state_of(node)
        assert after.last_seq == before.last_seq  # not one event while idle
        assert list(after.nodes) == list(before.nodes)  # and the master never timed it out
    finally:
        node.interrupt()
        nats.stop()
