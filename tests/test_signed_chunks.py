"""Token chunks that cannot be forged: each is signed with the key of the node that runs its run, and
the API node admits only chunks whose signature verifies against that node's key in State. The
issue's attack (with the shared `exo` credential: a chunk with a higher `attempt`, then one with
`finish_reason: "stop"`) and a chunk signed by another node's valid key are dropped and logged."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import secrets
import signal
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import msgspec
import nacl.signing
import nkeys
import pytest

from exo.bus.chunk_gate import ChunkGate
from exo.bus.chunk_signing import SIGNATURE_HEADER, SIGNER_HEADER, ChunkSigner, signature_valid
from exo.bus.connection import connect
from exo.bus.event_log import EventLog
from exo.bus.subjects import token_subject
from exo.bus.token_stream import publish_chunk, resume_point
from exo.core.events import InstanceCreated, NodeHeartbeat, NodeRegistered, TaskCreated, TaskMigrated
from exo.core.ids import CommandId, InstanceId, ModelId, NodeId, TaskId
from exo.core.requests import TokenChunk
from exo.core.state import State
from exo.core.types import Instance, NodeInfo, ShardAssignment, Task
from tests.support import as_master
from tests.support.e2e import Reference, exo_serving, place
from tests.support.exo_process import ExoProcess, runner_pids
from tests.support.tiny_model import TINY_MODEL_ID, make_tiny_model


def new_seed() -> bytes:
    return bytes(nkeys.encode_seed(secrets.token_bytes(32), nkeys.PREFIX_BYTE_USER))


def public_key_of(seed: bytes) -> str:
    return bytes(nkeys.from_seed(bytearray(seed)).public_key).decode()


A_SEED, B_SEED, C_SEED = new_seed(), new_seed(), new_seed()


def instance(instance_id: str, *nodes: str) -> Instance:
    return Instance(instance_id=InstanceId(instance_id), model_id=ModelId("m/a"),
                    shards=[ShardAssignment(runner_id=f"r-{instance_id}-{n}", node_id=NodeId(n), rank=i, world_size=len(nodes))
                            for i, n in enumerate(nodes)])


def registered(node: str, key: str = "", memory: int = 1) -> NodeRegistered:
    return NodeRegistered(node=NodeInfo(node_id=NodeId(node), public_key=key, memory_total=memory))


# --- the reducer: a node's first key sticks -----------------------------------------------------------------------

def test_a_nodes_first_key_stays_and_the_rest_of_a_later_registration_is_folded():
    first, other = public_key_of(A_SEED), public_key_of(B_SEED)
    state = as_master.fold([registered("a", first, memory=1)])
    assert state.nodes[NodeId("a")].public_key == first
    state = as_master.fold([registered("a", other, memory=2)], state)
    assert state.nodes[NodeId("a")].public_key == first and state.nodes[NodeId("a")].memory_total == 2
    state = as_master.fold([NodeHeartbeat(node=NodeInfo(node_id=NodeId("a"), memory_total=3))], state)  # no key: not erased
    assert state.nodes[NodeId("a")].public_key == first and state.nodes[NodeId("a")].memory_total == 3


def test_a_node_without_a_key_gets_one_at_its_first_registration_that_has_one():
    state = as_master.fold([registered("old"), registered("old", public_key_of(C_SEED))])
    assert state.nodes[NodeId("old")].public_key == public_key_of(C_SEED)


def test_each_run_of_a_task_keeps_the_nodes_of_its_instance_after_the_instance_is_gone():
    task = Task(task_id=TaskId("t"), instance_id=InstanceId("i1"), model_id=ModelId("m/a"))
    state = as_master.fold([InstanceCreated(instance=instance("i1", "a", "b")), InstanceCreated(instance=instance("i2", "c")),
                            TaskCreated(task=task)])
    assert state.tasks[TaskId("t")].run_nodes == [["a", "b"]]
    state = as_master.fold([TaskMigrated(task_id=TaskId("t"), to_instance=InstanceId(""), reason="gone", at=1.0),
                            TaskMigrated(task_id=TaskId("t"), to_instance=InstanceId("i2"), reason="placed", at=2.0)], state)
    assert state.tasks[TaskId("t")].run_nodes == [["a", "b"], ["c"]]


# --- signatures, checked with nacl itself -------------------------------------------------------------------------

def test_a_signature_is_ed25519_over_the_subject_and_the_exact_payload_by_the_nodes_nkey():
    payload = b'{"command_id":"x","index":0,"text":"hi"}'
    headers = ChunkSigner("a", A_SEED).headers("exo.tokens.x", payload)
    assert headers[SIGNER_HEADER] == "a"
    raw_public = nkeys.from_seed(bytearray(A_SEED)).public_key
    verify_key = nacl.signing.VerifyKey(base64.b32decode(raw_public)[1:33])
    verify_key.verify(b"exo.tokens.x\0" + payload, base64.b64decode(headers[SIGNATURE_HEADER]))
    assert signature_valid(public_key_of(A_SEED), "exo.tokens.x", payload, headers[SIGNATURE_HEADER])
    assert not signature_valid(public_key_of(A_SEED), "exo.tokens.y", payload, headers[SIGNATURE_HEADER])  # moved
    assert not signature_valid(public_key_of(A_SEED), "exo.tokens.x", payload + b" ", headers[SIGNATURE_HEADER])
    assert not signature_valid(public_key_of(B_SEED), "exo.tokens.x", payload, headers[SIGNATURE_HEADER])
    assert not signature_valid("Unot-a-key", "exo.tokens.x", payload, headers[SIGNATURE_HEADER])
    assert not signature_valid(public_key_of(A_SEED), "exo.tokens.x", payload, "!!not base64")


# --- the API node's gate, on a State built by hand ----------------------------------------------------------------

def cluster(*, keyless_runner: bool = False) -> State:
    """Task t runs on instance i1 (nodes a and b); c is another node of the cluster."""
    task = Task(task_id=TaskId("t"), instance_id=InstanceId("i1"), model_id=ModelId("m/a"))
    return as_master.fold([registered("a", "" if keyless_runner else public_key_of(A_SEED)),
                           registered("b", public_key_of(B_SEED)), registered("c", public_key_of(C_SEED)),
                           InstanceCreated(instance=instance("i1", "a", "b")), TaskCreated(task=task)])


def chunk_bytes(attempt: int = 0, finish: str | None = None) -> bytes:
    return msgspec.json.encode(TokenChunk(command_id=CommandId("t"), index=3, text="x", attempt=attempt,
                                          finish_reason=finish))  # type: ignore[arg-type]


async def admitted(state: State, payload: bytes, seed: bytes | None, signer: str, subject: str = "exo.tokens.t",
                   lag_s: float = 0.2) -> bool:
    headers = ChunkSigner(signer, seed).headers(subject, payload) if seed is not None else None
    return await ChunkGate(lambda: state, state_lag_s=lag_s).admits(CommandId("t"), "exo.tokens.t", payload, headers)


async def test_the_gate_admits_a_chunk_signed_by_any_rank_of_the_runs_instance():
    assert await admitted(cluster(), chunk_bytes(), A_SEED, "a")
    assert await admitted(cluster(), chunk_bytes(finish="stop"), B_SEED, "b")


async def test_the_gate_drops_forgeries_and_logs_each_publisher_once(caplog):
    state = cluster()
    assert not await admitted(state, chunk_bytes(), None, "")  # the shared credential, unsigned
    assert not await admitted(state, chunk_bytes(), C_SEED, "c")  # a real node's valid key, not this task's
    assert not await admitted(state, chunk_bytes(), C_SEED, "a")  # claims a, signed with c's key
    assert not await admitted(state, chunk_bytes(), A_SEED, "a", subject="exo.tokens.other")  # moved from another stream
    assert not await admitted(state, chunk_bytes(attempt=1), A_SEED, "a")  # a run State never shows
    gate = ChunkGate(lambda: state)
    for _ in range(3):
        assert not await gate.admits(CommandId("t"), "exo.tokens.t", chunk_bytes(finish="stop"), None)
    assert gate.dropped == 3
    drops = [r.getMessage() for r in caplog.records if "dropped a forged token chunk" in r.getMessage()]
    assert sum("claiming publisher (unsigned)" in d for d in drops) == 2  # once per gate and publisher
    assert any("node c does not run this run" in d for d in drops)
    assert any("does not verify against node a's key" in d for d in drops)
    assert any("State shows no run 1 of this task" in d for d in drops)


async def test_unsigned_chunks_pass_only_from_a_run_that_a_node_without_a_key_takes_part_in():
    assert await admitted(cluster(keyless_runner=True), chunk_bytes(), None, "")
    assert not await admitted(cluster(keyless_runner=True), chunk_bytes(), C_SEED, "a")  # a keyless node does not sign


async def test_a_chunk_ahead_of_this_nodes_state_waits_for_it():
    before = as_master.fold([InstanceCreated(instance=instance("i2", "c"))], cluster())  # placed, the task not moved yet
    after = as_master.fold([TaskMigrated(task_id=TaskId("t"), to_instance=InstanceId("i2"), reason="moved", at=1.0)], before)
    views = [before]
    gate = ChunkGate(lambda: views[-1], state_lag_s=5.0)
    payload = chunk_bytes(attempt=1)
    asyncio.get_running_loop().call_later(0.1, views.append, after)
    assert await gate.admits(CommandId("t"), "exo.tokens.t", payload, ChunkSigner("c", C_SEED).headers("exo.tokens.t", payload))
    # run 0's nodes are still known once its instance is gone: a replay of its stored chunks passes
    assert await admitted(after, chunk_bytes(attempt=0), A_SEED, "a")


async def test_an_earlier_run_whose_nodes_were_never_recorded_may_be_signed_by_any_node_by_its_own_key():
    """A master group's log holds no instances, so its tasks' runs have no recorded nodes."""
    task = Task(task_id=TaskId("t"), instance_id=InstanceId("elsewhere"), model_id=ModelId("m/a"))
    state = as_master.fold([registered("a", public_key_of(A_SEED)), registered("c", public_key_of(C_SEED)),
                            InstanceCreated(instance=instance("i2", "a")), TaskCreated(task=task),
                            TaskMigrated(task_id=TaskId("t"), to_instance=InstanceId("i2"), reason="moved", at=1.0)])
    assert state.tasks[TaskId("t")].run_nodes == [[], ["a"]]
    assert await admitted(state, chunk_bytes(attempt=0), C_SEED, "c")
    assert not await admitted(state, chunk_bytes(attempt=0), C_SEED, "a")
    assert not await admitted(state, chunk_bytes(attempt=0), None, "")
    assert not await admitted(state, chunk_bytes(attempt=1), C_SEED, "c")


async def test_a_resumed_run_takes_only_the_earlier_runs_signed_chunks(nc):
    """The worker resuming a migrated task reads run 0's stored chunks through the gate: a forged
    one is a gap (generated again), never tokens of the resumed prompt."""
    task_id = uuid.uuid4().hex
    task = Task(task_id=TaskId(task_id), instance_id=InstanceId("i1"), model_id=ModelId("m/a"))
    state = as_master.fold([registered("a", public_key_of(A_SEED)), InstanceCreated(instance=instance("i1", "a")),
                            InstanceCreated(instance=instance("i2", "a")), TaskCreated(task=task),
                            TaskMigrated(task_id=TaskId(task_id), to_instance=InstanceId("i2"), reason="moved", at=1.0)])
    real = ChunkSigner("a", A_SEED)
    for index, (ids, signer) in enumerate([([5, 6], real), ([7], real), ([99], None), ([8], real)]):
        await publish_chunk(nc, TokenChunk(command_id=CommandId(task_id), index=index, token_ids=ids), signer)
    await publish_chunk(nc, TokenChunk(command_id=CommandId(task_id), index=4, token_ids=[9], finish_reason="stop"), real)
    assert await resume_point(nc, CommandId(task_id), 1, timeout=2.0) == ([5, 6, 7, 99, 8], 4)  # no gate: the forgery
    assert await resume_point(nc, CommandId(task_id), 1, timeout=2.0, gate=ChunkGate(lambda: state)) == ([5, 6, 7], 2)


async def test_a_forgery_claiming_a_later_run_does_not_stall_the_stream_behind_it():
    """Only a chunk validly signed by a node of one of State's instances waits for State to show its
    run: the shared credential's, or a node's that runs nothing, is dropped at once."""
    loop = asyncio.get_running_loop()
    for seed, signer in ((None, ""), (C_SEED, "c"), (C_SEED, "a")):
        started = loop.time()
        assert not await admitted(cluster(), chunk_bytes(attempt=1), seed, signer, lag_s=5.0)
        assert loop.time() - started < 0.5


# --- the attack, end to end: one exo process, the tiny model, mlx-lm's text ----------------------------------------

MESSAGES = [{"role": "user", "content": "Tell me about the sea."}]
MAX_TOKENS = 120


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("model") / "tiny-llama")


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[ExoProcess]:
    with exo_serving(tmp_path_factory.mktemp("node"), {TINY_MODEL_ID: model_dir},
                     env={"EXO_STREAM_INTERVAL_MS": "0"}) as exo:
        with httpx.Client(base_url=exo.url, timeout=120) as http:
            place(http, TINY_MODEL_ID)
        yield exo


def streamed_text(node: ExoProcess) -> tuple[str, str | None]:
    """The text and finish reason of a streamed greedy chat, as a client reads them."""
    text, finish = "", None
    body = {"model": TINY_MODEL_ID, "messages": MESSAGES, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True}
    with httpx.Client(base_url=node.url, timeout=120) as http, http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"][0]
            text += choice["delta"].get("content") or ""
            finish = choice.get("finish_reason") or finish
    return text, finish


async def attack_while(node: ExoProcess, signer: ChunkSigner | None, attempt: int,
                       register: NodeInfo | None = None) -> tuple[str, str | None, str]:
    """A client's greedy stream, and with the shared `exo` credential, as soon as its first chunk is out:
    a chunk of run `attempt` with foreign text, then one that ends it. The client's text and finish, and the task."""
    nc = await connect([node.nats_url()], name="forger")
    try:
        if register is not None:
            await EventLog(nc).append(NodeRegistered(node=register), uuid.uuid4().hex)
        seen: asyncio.Future[str] = asyncio.get_running_loop().create_future()

        # The runner is paused from its first chunk on while the forgeries go out: its 120 tokens can
        # all be out before this process (on a loaded machine) publishes them, and a forgery reaching
        # the API after the stream ended meets no listener: nothing is dropped, nothing said (a race a
        # CI run could lose). It resumes once the API said it dropped them, the client's stream still open.
        assert node.process is not None
        runners = runner_pids(node.process.pid)
        assert runners, "no runner process of the node"

        async def on_chunk(msg) -> None:  # type: ignore[no-untyped-def]
            if not seen.done():
                for pid in runners:
                    os.kill(pid, signal.SIGSTOP)
                seen.set_result(msg.subject.rsplit(".", 1)[1])

        sub = await nc.subscribe(token_subject(CommandId("*")), cb=on_chunk)
        result: list[tuple[str, str | None]] = []
        reader = threading.Thread(target=lambda: result.append(streamed_text(node)))
        reader.start()
        try:
            task_id = await asyncio.wait_for(seen, 60)
            await sub.unsubscribe()
            for chunk in (TokenChunk(command_id=CommandId(task_id), index=1, text=" FORGED TEXT", attempt=attempt),
                          TokenChunk(command_id=CommandId(task_id), index=2, attempt=attempt, finish_reason="stop")):
                await publish_chunk(nc, chunk, signer)
            deadline = asyncio.get_running_loop().time() + 20  # well within EXO_RUNNER_STALL_S (30 s)
            while f"dropped a forged token chunk of task {task_id} " not in node.output():  # noqa: ASYNC110
                assert asyncio.get_running_loop().time() < deadline, "the API never said it dropped the forgery"
                await asyncio.sleep(0.05)
        finally:
            for pid in runners:
                os.kill(pid, signal.SIGCONT)
        await asyncio.to_thread(reader.join, 120)
        return *result[0], task_id
    finally:
        await nc.close()


@pytest.mark.slow
async def test_the_issues_stream_injection_is_dropped_and_the_client_gets_mlx_lms_text(node, model_dir):
    expected = Reference(model_dir).chat(MESSAGES, MAX_TOKENS)
    text, finish, task_id = await attack_while(node, signer=None, attempt=1)
    assert (text, finish) == (expected, "length"), node.output()[-4000:]
    assert f"dropped a forged token chunk of task {task_id} claiming publisher (unsigned)" in node.output()


@pytest.mark.slow
async def test_a_chunk_signed_by_another_registered_node_is_dropped(node, model_dir):
    expected = Reference(model_dir).chat(MESSAGES, MAX_TOKENS)
    intruder = NodeInfo(node_id=NodeId("intruder"), public_key=public_key_of(C_SEED))
    text, finish, task_id = await attack_while(node, ChunkSigner("intruder", C_SEED), attempt=0, register=intruder)
    assert (text, finish) == (expected, "length"), node.output()[-4000:]
    dropped = f"dropped a forged token chunk of task {task_id} claiming publisher intruder: node intruder does not run"
    assert dropped in node.output()


@pytest.mark.slow
def test_a_node_whose_key_file_was_replaced_refuses_to_start_and_says_how_to_fix_it(tmp_path):
    """The first key stays, so a node signing with another would have every chunk dropped: it must not start."""
    exo = ExoProcess(tmp_path / "data", {}).start()
    assert exo.interrupt() == 0
    key_file = tmp_path / "data" / "node.nk"
    key_file.write_bytes(nkeys.encode_seed(secrets.token_bytes(32), nkeys.PREFIX_BYTE_USER))
    try:
        with pytest.raises(RuntimeError, match="exo exited") as refused:
            exo.start()
    finally:
        if exo.process is not None and exo.process.poll() is None:
            exo.interrupt()
    assert "by another key than" in str(refused.value) and "put the original file back" in str(refused.value)
