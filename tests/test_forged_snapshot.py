"""A forged or corrupt State snapshot cannot freeze a node: one that claims a sequence the log has
not reached (10^9), or that does not decode, is passed over for an older revision, and the
master's next snapshot replaces it (it used to keep it forever as "newer"). Nor can another master
group's State under a group's snapshot key: it folded another log."""

from __future__ import annotations

import uuid

import msgspec

from exo.bus.catch_up import catch_up
from exo.bus.connection import connect
from exo.bus.event_log import EventLog
from exo.bus.provision import provision, provision_group
from exo.bus.snapshots import read_latest_snapshot, write_snapshot
from exo.bus.subjects import SNAPSHOT_KEY, STATE_BUCKET, group_names
from exo.core.events import LeaderElected, NodeRegistered
from exo.core.state import encode_state
from exo.core.types import NodeInfo


async def test_a_snapshot_beyond_the_log_or_undecodable_is_passed_over_and_replaced(fresh_nats: str):
    nc = await connect([fresh_nats], name="t")
    try:
        await provision(nc)
        log = EventLog(nc)
        for n in range(5):
            await log.append(NodeRegistered(node=NodeInfo(node_id=f"n{n}")), uuid.uuid4().hex)
        honest, _ = await catch_up(nc, use_snapshot=False)
        await honest.stop()
        assert await write_snapshot(nc, honest.state)
        kv = await nc.jetstream().key_value(STATE_BUCKET)
        forged = msgspec.structs.replace(honest.state, last_seq=10**9, nodes={})
        await kv.put(SNAPSHOT_KEY, b"{not json")
        await kv.put(SNAPSHOT_KEY, encode_state(forged))

        assert await read_latest_snapshot(nc) == honest.state  # two revisions back
        for n in range(5, 8):
            await log.append(NodeRegistered(node=NodeInfo(node_id=f"n{n}")), uuid.uuid4().hex)
        view, from_seq = await catch_up(nc)  # a late joiner: sees every node, follows new events
        try:
            assert from_seq == 5 and view.state.last_seq == 8 and len(view.state.nodes) == 8
            assert await write_snapshot(nc, view.state)  # the master's next snapshot goes over the forged one
            assert await read_latest_snapshot(nc) == view.state
        finally:
            await view.stop()
    finally:
        await nc.close()


async def test_a_groups_state_under_another_groups_key_is_passed_over(fresh_nats: str):
    nc = await connect([fresh_nats], name="t")
    try:
        await provision(nc)
        a, b = group_names("a"), group_names("b")
        for names, count in ((a, 3), (b, 5)):  # A's State covers a sequence B's log has reached
            await provision_group(nc, names)
            for n in range(count):
                elected = LeaderElected(node_id=f"{names.group}{n}", lease_revision=n + 1)
                await EventLog(nc, names).append(elected, uuid.uuid4().hex)
        folded = {}
        for names in (a, b):
            view, _ = await catch_up(nc, use_snapshot=False, names=names)
            await view.stop()
            folded[names.group] = view.state
        kv = await nc.jetstream().key_value(STATE_BUCKET)
        await kv.put(b.snapshot_key, encode_state(folded["a"]))

        assert await read_latest_snapshot(nc, b) is None
        view, from_seq = await catch_up(nc, names=b)  # B's whole log, from its start
        await view.stop()
        assert from_seq == 0 and view.state == folded["b"]
        assert (view.state.group, view.state.last_seq, view.state.leader_node) == ("b", 5, "b4")
    finally:
        await nc.close()
