"""Events signed by their writer's node key, and the reducer asking for the right signer
(exo/core/event_signers.py): a master's decisions by the key of its term's election, a node's own
events by that node's key once it signs them. The signatures are real (exo/bus/chunk_signing.py)."""

from __future__ import annotations

import asyncio
import secrets
import uuid
from collections.abc import Iterator

import nkeys
import pytest
from msgspec.structs import replace

from exo.bus.chunk_signing import ChunkSigner, message_check
from exo.bus.connection import connect
from exo.bus.event_log import EventLog
from exo.bus.subjects import SHARED
from exo.core.apply import apply
from exo.core.event_signers import SignatureCheck, is_signed
from exo.core.events import (
    AnyEvent,
    InstanceDeleted,
    KeySet,
    LeaderElected,
    NodeHeartbeat,
    NodeRegistered,
    TaskCreated,
    encode_event,
    event_tag,
)
from exo.core.keys import ApiKey
from exo.core.state import State
from exo.core.types import Instance, NodeInfo, Task
from tests.support.cluster import state_of, wait_until
from tests.support.e2e import start_exo
from tests.support.exo_process import ExoProcess
from tests.support.exo_tools import json_lines, run_tool
from tests.support.fake_hub import FakeHub

MASTER, WORKER, STRANGER = (ChunkSigner(name, nkeys.encode_seed(secrets.token_bytes(32), nkeys.PREFIX_BYTE_USER))
                            for name in ("master", "w1", "stranger"))


def signed_by(signer: ChunkSigner | None, event: AnyEvent) -> SignatureCheck:
    """The check a follower builds for `event` as `signer` appended it (None: unsigned)."""
    subject, payload = SHARED.event_subject(event_tag(event)), encode_event(event)
    return message_check(subject, payload, signer.headers(subject, payload) if signer else None)


def fold(state: State, event: AnyEvent, signer: ChunkSigner | None) -> State:
    return apply(state, event, state.last_seq + 1, signed_by(signer, event))


def elected(signer: ChunkSigner | None, key: str | None = None) -> State:
    """A State with an instance and node w1 (registered, signing), led by a master elected as `signer` signed."""
    state = fold(State(), NodeRegistered(node=NodeInfo(node_id="w1", public_key=WORKER.public_key)), WORKER)
    election = LeaderElected(node_id="m1", lease_revision=1, public_key=MASTER.public_key if key is None else key)
    state = fold(state, election, signer)
    return replace(state, instances={"i1": Instance(instance_id="i1", model_id="m")})


def deleted(state: State, signer: ChunkSigner | None) -> State:
    return fold(state, InstanceDeleted(instance_id="i1", reason="forged?", term=state.leader_term), signer)


def last_skip(before: State, after: State) -> str:
    return after.skipped_events[-1].reason if len(after.skipped_events) > len(before.skipped_events) else ""


def test_a_master_event_needs_the_signature_of_its_terms_elected_key():
    state = elected(MASTER)
    assert state.leader_key == MASTER.public_key
    assert "i1" not in deleted(state, MASTER).instances
    for forger in (None, STRANGER, WORKER):  # the shared credential alone; another node's key
        after = deleted(state, forger)
        assert "i1" in after.instances
        assert last_skip(state, after) == f"a master's event not signed by the key of term {state.leader_term}'s leader"


def test_a_master_elected_unsigned_is_asked_for_nothing_and_either_release_may_take_over():
    """An older release's master signs nothing: its term asks for no signature, so a mixed cluster
    fails over both ways (the residual: a forger's unsigned election does the same, until the real
    master elects itself again; docs/reliability.md)."""
    state = elected(None)
    assert state.leader_key == ""
    assert "i1" not in deleted(state, None).instances
    older = fold(elected(MASTER), LeaderElected(node_id="m2", lease_revision=2, public_key=STRANGER.public_key), None)
    assert older.leader_node == "m2" and older.leader_key == ""
    assert "i1" not in deleted(older, None).instances
    claimed = fold(elected(MASTER), LeaderElected(node_id="m2", lease_revision=2, public_key=STRANGER.public_key),
                   MASTER)  # signed, but not by the key it names: that key is given nothing
    assert claimed.leader_key == ""
    newer = fold(older, LeaderElected(node_id="m1", lease_revision=3, public_key=MASTER.public_key), MASTER)
    assert newer.leader_key == MASTER.public_key and "i1" in deleted(newer, None).instances


def test_a_node_that_signs_its_events_cannot_be_spoken_for_by_others():
    state = elected(MASTER)
    assert state.nodes["w1"].signs_events
    forged = NodeHeartbeat(node=NodeInfo(node_id="w1", hostname="forged", public_key=WORKER.public_key))
    for forger in (None, STRANGER, MASTER):
        after = fold(state, forged, forger)
        assert after.nodes["w1"].hostname == "" and last_skip(state, after) == \
            "a NodeHeartbeat of node w1 not signed by its key"
    real = fold(state, replace(forged, node=replace(forged.node, hostname="w1-host", signs_events=False)), WORKER)
    assert real.nodes["w1"].hostname == "w1-host" and real.nodes["w1"].signs_events  # a node's own claim is not asked


def test_a_node_of_an_older_release_is_asked_for_nothing():
    state = fold(State(), NodeRegistered(node=NodeInfo(node_id="old", public_key=WORKER.public_key)), None)
    assert not state.nodes["old"].signs_events
    state = fold(state, NodeHeartbeat(node=NodeInfo(node_id="old", hostname="still-old")), None)
    assert state.nodes["old"].hostname == "still-old"


def test_a_requests_own_events_are_neither_signed_nor_asked_for():
    state = elected(MASTER)
    created = TaskCreated(task=Task(task_id="t1", instance_id="i1", model_id="m"), term=state.leader_term)
    assert not is_signed(created) and is_signed(InstanceDeleted(instance_id="i1"))
    assert "t1" in fold(state, created, None).tasks


def test_a_caller_that_appended_the_event_itself_checks_nothing():
    state = elected(MASTER)
    forged = InstanceDeleted(instance_id="i1", reason="own", term=state.leader_term)
    assert "i1" not in apply(state, forged, state.last_seq + 1).instances


# --- a live node, attacked with the shared credential ------------------------------------------


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ExoProcess]:
    with FakeHub({}) as hub:
        node = start_exo(tmp_path_factory.mktemp("signed-events"), hub)
        yield node
        node.interrupt()


def appended(node: ExoProcess, events: list[AnyEvent], signer: ChunkSigner | None) -> list[int]:
    async def append() -> list[int]:
        nc = await connect([node.nats_url()], name="forger")
        try:
            log = EventLog(nc, signer=signer)
            return [await log.append(event, uuid.uuid4().hex) for event in events]
        finally:
            await nc.close()
    return asyncio.run(append())


def test_a_forged_admin_key_and_heartbeat_are_skipped_by_the_node_and_by_replay(live):
    state = state_of(live)
    (node_id,) = state.nodes
    assert state.leader_key and state.nodes[node_id].signs_events
    admin = ApiKey(key_id="key_" + "f" * 16, secret_sha256="0" * 64, name="forged", admin=True)
    forgeries = [KeySet(key=admin, term=state.leader_term),
                 NodeHeartbeat(node=replace(state.nodes[node_id], hostname="forged-host"))]
    seqs = [*appended(live, forgeries, None), *appended(live, forgeries, STRANGER)]
    wait_until(lambda: state_of(live).last_seq >= seqs[-1], 10, 0.05, "the forgeries folded")
    after = state_of(live)
    assert admin.key_id not in after.api_keys and after.nodes[node_id].hostname != "forged-host"
    reasons = {s.seq: s.reason for s in after.skipped_events}
    master_skip = f"a master's event not signed by the key of term {state.leader_term}'s leader"
    node_skip = f"a NodeHeartbeat of node {node_id} not signed by its key"
    assert [reasons.get(seq) for seq in seqs] == [master_skip, node_skip] * 2
    done = run_tool(["replay", "--json"], live.nats_url())  # the log's reader checks as the node does
    (replayed,) = [line for line in json_lines(done.stdout) if line["type"] == "result"]
    assert {s["seq"]: s["reason"] for s in replayed["skipped"] if s["seq"] in seqs} == {s: reasons[s] for s in seqs}
    assert replayed["state"]["leader_key"] == after.leader_key
    assert replayed["state"]["nodes"][node_id]["signs_events"]
