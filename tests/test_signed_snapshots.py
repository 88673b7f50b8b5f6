"""Snapshots signed by the leading master with its node key: a starting node uses one only if the
log shows its signer leading a term, and the signature verifies with the key its election carried.
Plausible forgeries written with the shared credential (right group, a sequence the log has
reached, a valid State) are passed over for the older signed snapshot, each with a warning."""

from __future__ import annotations

import base64
import logging
import uuid
from pathlib import Path

import msgspec
import nacl.signing
import pytest

from exo.bus.catch_up import catch_up
from exo.bus.chunk_signing import SIGNATURE_HEADER, SIGNER_HEADER, ChunkSigner
from exo.bus.connection import connect
from exo.bus.event_log import EventLog
from exo.bus.provision import provision, provision_group
from exo.bus.server.node_keys import load_node_key
from exo.bus.snapshots import STATE_STREAM, read_latest_snapshot, write_snapshot
from exo.bus.subjects import SHARED, STATE_BUCKET, LogNames, group_names, snapshot_subject
from exo.core.apply import apply_all
from exo.core.events import LeaderElected, NodeRegistered
from exo.core.ids import NodeId
from exo.core.snapshot_trust import SnapshotSigners, snapshot_refusal, snapshot_signers
from exo.core.state import State, decode_state, encode_state
from exo.core.types import NodeInfo


def signer_of(tmp_path: Path, node_id: str) -> ChunkSigner:
    return ChunkSigner.from_file(node_id, load_node_key(tmp_path / node_id).seed_file)


async def forge(nc, names: LogNames, payload: bytes, headers: dict[str, str] | None = None) -> None:
    """What anyone holding the shared `exo` credential can do: publish on the snapshot's key."""
    await nc.jetstream().publish(snapshot_subject(names), payload, headers=headers)


def not_used(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "not used" in r.getMessage()]


async def test_only_a_snapshot_signed_by_a_master_the_log_shows_is_used(fresh_nats: str, tmp_path: Path, caplog):
    caplog.set_level(logging.WARNING, logger="exo.bus.snapshots")
    master, worker = signer_of(tmp_path, "m1"), signer_of(tmp_path, "w1")
    nc = await connect([fresh_nats], name="t")
    try:
        await provision(nc)
        log = EventLog(nc)
        await log.append(NodeRegistered(node=NodeInfo(node_id="m1", public_key=master.public_key)), uuid.uuid4().hex)
        await log.append(NodeRegistered(node=NodeInfo(node_id="w1", public_key=worker.public_key)), uuid.uuid4().hex)
        await log.append(LeaderElected(node_id="m1", lease_revision=1, public_key=master.public_key), uuid.uuid4().hex)
        honest, _ = await catch_up(nc, use_snapshot=False)
        await honest.stop()
        assert await write_snapshot(nc, honest.state, signer=master)

        # The stored value is the State JSON (`nats kv get exo-state snapshot`), its signature an
        # ed25519 one over subject NUL payload, checked here with PyNaCl itself.
        kv = await nc.jetstream().key_value(STATE_BUCKET)
        assert decode_state((await kv.get("snapshot")).value) == honest.state
        stored = await nc.jetstream().get_msg(STATE_STREAM, subject=snapshot_subject(SHARED))
        assert stored.headers[SIGNER_HEADER] == "m1"
        verify_key = nacl.signing.VerifyKey(base64.b32decode(master.public_key)[1:33])  # prefix, key, CRC-16
        verify_key.verify(b"$KV.exo-state.snapshot\0" + stored.data, base64.b64decode(stored.headers[SIGNATURE_HEADER]))
        assert await read_latest_snapshot(nc) == honest.state

        # Three plausible forgeries at the same sequence, each a valid State of this log.
        forged = encode_state(msgspec.structs.replace(honest.state, nodes={}))
        await forge(nc, SHARED, forged)  # unsigned
        await forge(nc, SHARED, forged, worker.headers(snapshot_subject(SHARED), forged))  # a node that never led
        altered = encode_state(msgspec.structs.replace(honest.state, leader_node="w1"))
        await forge(nc, SHARED, altered, master.headers(snapshot_subject(SHARED), encode_state(honest.state)))
        caplog.clear()
        assert await read_latest_snapshot(nc) == honest.state  # three revisions back
        assert not_used(caplog) == [
            "snapshot revision 4 not used: its signature does not verify with node m1's key (changed after it was "
            "signed?); trying older revisions",
            "snapshot revision 3 not used: its signer w1 never led a term in the log",
            "snapshot revision 2 not used: it is unsigned, and the log's leader m1 has a key",
        ]

        # The master writing the same sequence again goes over the forgeries (an unverified one "as
        # new" would have been kept).
        assert await write_snapshot(nc, honest.state, signer=master)
        caplog.clear()
        assert await read_latest_snapshot(nc) == honest.state and not_used(caplog) == []

        # A late joiner starts from the signed one; the master's next snapshot follows it.
        await log.append(NodeRegistered(node=NodeInfo(node_id="n9")), uuid.uuid4().hex)
        view, from_seq = await catch_up(nc)
        try:
            assert (from_seq, view.state.last_seq, sorted(view.state.nodes)) == (3, 4, ["m1", "n9", "w1"])
            assert await write_snapshot(nc, view.state, signer=master)
            assert await read_latest_snapshot(nc) == view.state
        finally:
            await view.stop()
    finally:
        await nc.close()


async def test_unsigned_snapshots_are_used_only_while_the_leader_has_no_key(fresh_nats: str, tmp_path: Path):
    """Mid-upgrade an older master writes unsigned snapshots; once a master with a key leads, they are not used."""
    master = signer_of(tmp_path, "m2")
    nc = await connect([fresh_nats], name="t")
    try:
        await provision(nc)
        log = EventLog(nc)
        await log.append(LeaderElected(node_id="old", lease_revision=1), uuid.uuid4().hex)
        old, _ = await catch_up(nc, use_snapshot=False)
        await old.stop()
        assert await write_snapshot(nc, old.state)  # unsigned, as an older master writes
        assert await read_latest_snapshot(nc) == old.state
        # A master-only node: its key comes from its election (it never registers).
        await log.append(LeaderElected(node_id="m2", lease_revision=2, public_key=master.public_key), uuid.uuid4().hex)
        assert await read_latest_snapshot(nc) is None
        new, _ = await catch_up(nc, use_snapshot=False)
        await new.stop()
        assert await write_snapshot(nc, new.state, signer=master)  # goes over the unsigned one at once
        assert await read_latest_snapshot(nc) == new.state
    finally:
        await nc.close()


async def test_a_groups_snapshot_is_checked_against_the_groups_own_elections(fresh_nats: str, tmp_path: Path, caplog):
    caplog.set_level(logging.WARNING, logger="exo.bus.snapshots")
    leader, other = signer_of(tmp_path, "g1"), signer_of(tmp_path, "s1")
    chat = group_names("chat")
    nc = await connect([fresh_nats], name="t")
    try:
        await provision(nc)
        await provision_group(nc, chat)
        # s1 led the shared log, not chat's: its signature is no good for chat's snapshot.
        await EventLog(nc).append(LeaderElected(node_id="s1", lease_revision=1, public_key=other.public_key), "e1")
        group_log = EventLog(nc, chat)
        await group_log.append(LeaderElected(node_id="g1", lease_revision=1, public_key=leader.public_key), "e2")
        view, _ = await catch_up(nc, use_snapshot=False, names=chat)
        await view.stop()
        assert await write_snapshot(nc, view.state, names=chat, signer=leader)
        forged = encode_state(msgspec.structs.replace(view.state, leader_node=NodeId("s1")))
        await forge(nc, chat, forged, other.headers(snapshot_subject(chat), forged))
        caplog.clear()
        assert await read_latest_snapshot(nc, chat) == view.state
        assert not_used(caplog) == ["snapshot revision 2 not used: its signer s1 never led a term in the log; "
                                    "trying older revisions"]
        assert await read_latest_snapshot(nc) is None  # the shared log's key holds nothing
    finally:
        await nc.close()



def test_leaders_are_the_elections_the_reducer_accepts():
    """An old-scheme election written after elections by sequence is skipped by the reducer: its
    node leads no term, so its signature is no good."""
    elections = [(1, LeaderElected(node_id="m1", lease_revision=1, public_key="K1")),
                 (2, LeaderElected(node_id="x", term=99, public_key="KX")),
                 (3, LeaderElected(node_id="m1", lease_revision=2, public_key="K2"))]
    signers = snapshot_signers("", elections)
    assert signers == SnapshotSigners(keys={"m1": "K1"}, leaders=frozenset({"m1"}), current_leader="m1")
    folded = apply_all(State(), [(event, seq) for seq, event in elections])
    assert (folded.leader_node, [s.seq for s in folded.skipped_events]) == ("m1", [2])
    assert snapshot_refusal(signers, "x", signed=True) == "its signer x never led a term in the log"


async def test_a_log_trimmed_past_every_election_cannot_check_a_signer_and_says_so(fresh_nats: str, tmp_path: Path, caplog):
    """With the elections gone from the log, no signer can be checked, and the tail alone cannot
    rebuild State: the newest snapshot is used as before signatures, with a warning that says why
    (refusing them all would stop every late joiner until the next election)."""
    caplog.set_level(logging.WARNING, logger="exo.bus.snapshots")
    master = signer_of(tmp_path, "m3")
    nc = await connect([fresh_nats], name="t")
    try:
        await provision(nc)
        log = EventLog(nc)
        await log.append(LeaderElected(node_id="m3", lease_revision=1, public_key=master.public_key), "e0")
        for n in range(4):
            await log.append(NodeRegistered(node=NodeInfo(node_id=f"n{n}")), f"e{n + 1}")
        view, _ = await catch_up(nc, use_snapshot=False)
        await view.stop()
        assert await write_snapshot(nc, view.state, signer=master)
        assert await read_latest_snapshot(nc) == view.state
        await nc.jetstream().purge_stream("EXO_EVENTS", keep=2)  # the election (sequence 1) is gone
        forged = encode_state(view.state)
        await forge(nc, SHARED, forged)
        caplog.clear()
        assert await read_latest_snapshot(nc) == view.state
        assert not_used(caplog) == []
        assert "EXO_EVENTS starts at sequence 4, past every election: the snapshot's signer cannot be checked" \
            in caplog.text
    finally:
        await nc.close()
