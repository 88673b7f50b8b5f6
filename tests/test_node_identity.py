"""Per-node NATS identities against a real nats-server started with their users
(exo/core/node_roles.py, exo/bus/server/node_keys.py): each node's nkey admits it with its roles'
permissions and no more. The shared `exo` password user sits beside them, as while a cluster
upgrades; here it provisions and watches what the nodes could not change."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import subprocess
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import get_args

import msgspec
import nats
import nkeys
import pytest
import pytest_asyncio
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from exo.bus.catch_up import catch_up
from exo.bus.event_log import EventLog
from exo.bus.leadership import Lease
from exo.bus.liveness import Pulse, send_pulse
from exo.bus.provision import provision
from exo.bus.server.embedded import MAX_PAYLOAD_BYTES, nats_server_binary, with_user
from exo.bus.server.node_keys import NodeKey, NodeKeyError, authorization_block, check_public_key, load_node_key
from exo.bus.server.node_subjects import NodeSubjects
from exo.bus.server.permissions import OPERATOR_PERMISSIONS
from exo.bus.snapshots import read_latest_snapshot, write_snapshot
from exo.bus.subjects import (
    COMMANDS_STREAM,
    EVENTS_STREAM,
    IMAGES_STREAM,
    LEADER_BUCKET,
    MASTER_CONSUMER,
    STATE_BUCKET,
    command_subject,
    download_control_subject,
    event_subject,
    model_share_subject,
    pulse_subject,
)
from exo.core.events import AnyEvent, InstanceDeleted, NodeHeartbeat, encode_event
from exo.core.ids import InstanceId, NodeId
from exo.core.node_roles import Role, kinds_written_by, node_permissions, operator_permissions
from exo.core.types import NodeInfo
from tests.conftest import eventually
from tests.support.polling import wait_until

WORKER, MASTER, OTHER = NodeId("worker-1"), NodeId("master-1"), NodeId("worker-2")
TODAY, PROPOSED = NodeSubjects(), NodeSubjects(writer_named=True)


@dataclass
class Server:
    url: str
    admin: Client  # the shared `exo` user
    keys: dict[str, NodeKey]


def start_server(root: Path, config_text: str) -> tuple[subprocess.Popen[bytes], str]:
    """nats-server with JetStream and that config; its URL once it listens (its ports file)."""
    config = root / "nats-server.conf"
    config.write_text(config_text)
    with open(root / "nats-server.log", "wb") as server_log:  # the server keeps its own copy
        process = subprocess.Popen([nats_server_binary(), "--config", str(config), "--jetstream", "--store_dir",
                                    str(root / "jetstream"), "-a", "127.0.0.1", "-p", "-1", "--ports_file_dir", str(root)],
                                   stdout=server_log, stderr=server_log)
    ports = wait_until(lambda: next(root.glob("*.ports"), None) and json.loads(next(root.glob("*.ports")).read_text()),
                       timeout=10, what="nats-server listening", tolerate=(ValueError,))
    return process, ports["nats"][0]


@pytest_asyncio.fixture(scope="module")
async def server(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Server]:
    root = tmp_path_factory.mktemp("node-identity")
    keys = {name: load_node_key(root / name) for name in ("worker", "master", "proposed-worker")}
    identities = [(keys["worker"].public_key, node_permissions(WORKER, [Role.WORKER], TODAY)),
                  (keys["master"].public_key, node_permissions(MASTER, [Role.MASTER], TODAY)),
                  (keys["proposed-worker"].public_key, node_permissions(WORKER, [Role.WORKER], PROPOSED))]
    password = secrets.token_hex(16)
    process, url = start_server(root, f"max_payload: {MAX_PAYLOAD_BYTES}\n"
                                + authorization_block(identities, also=[{"user": "exo", "password": password}]))
    try:
        admin = await nats.connect(with_user(url, "exo", password), max_reconnect_attempts=50, reconnect_time_wait=0.1)
        await provision(admin)
        yield Server(url, admin, keys)
        await admin.close()
    finally:
        process.terminate()
        process.wait(10)


async def as_node(server: Server, key: str, refusals: list[str], inbox_prefix: str = "_INBOX") -> Client:
    """A client holding that node's key; the server's refusals (asynchronous errors) collected."""

    async def on_error(error: Exception) -> None:
        refusals.append(str(error).lower())

    return await nats.connect(server.url, nkeys_seed=str(server.keys[key].seed_file), error_cb=on_error,
                              inbox_prefix=inbox_prefix)


async def last_seqs(js: JetStreamContext) -> dict[str, int]:
    streams = (EVENTS_STREAM, COMMANDS_STREAM, IMAGES_STREAM, f"KV_{STATE_BUCKET}", f"KV_{LEADER_BUCKET}")
    return {name: (await js.stream_info(name)).state.last_seq for name in streams}


def refused_subjects(refusals: list[str], what: str) -> set[str]:
    """The subjects of the server's refusals: 'permissions violation for publish to "x"'."""
    return {r.split('"')[1] for r in refusals if f"permissions violation for {what}" in r}


async def expect_refused(client: Client, refusals: list[str], publishes: list[str], subscriptions: list[str]) -> None:
    """Each publish and subscription refused by the server, and nothing else."""
    for subject in publishes:
        await client.publish(subject, encode_event(InstanceDeleted(instance_id=InstanceId("i1"), term=1)),
                             reply=client.new_inbox())
    for subject in subscriptions:
        await client.subscribe(subject)
    await client.flush()
    with contextlib.suppress(AssertionError):  # a refusal missing: the assertions below name it
        await eventually(lambda: len(refusals) >= len(publishes) + len(subscriptions), timeout=5)
    assert refused_subjects(refusals, "publish") == {s.lower() for s in publishes}
    assert refused_subjects(refusals, "subscription") == {s.lower() for s in subscriptions}
    assert len(refusals) == len(publishes) + len(subscriptions), refusals


def heartbeat(node: NodeId) -> NodeHeartbeat:
    return NodeHeartbeat(node=NodeInfo(node_id=node, name=node))


async def test_a_worker_writes_as_itself_and_the_server_refuses_it_the_rest(server: Server):
    refusals: list[str] = []
    worker = await as_node(server, "worker", refusals)
    pulses: list[str] = []

    async def on_pulse(msg: Msg) -> None:
        pulses.append(msg.subject)

    await server.admin.subscribe("exo.liveness.>", cb=on_pulse)
    await server.admin.flush()
    try:
        seq = await EventLog(worker).append(heartbeat(WORKER), uuid.uuid4().hex)  # exo's own append, as the worker
        await send_pulse(worker, Pulse(node_id=WORKER))
        view, _ = await catch_up(worker)  # the snapshot, the stream and an ordered consumer: its reads still work
        assert view.state.last_seq == seq
        await view.stop()
        before = await last_seqs(server.admin.jetstream())
        await expect_refused(worker, refusals, publishes=[
            event_subject("instance.deleted"),  # a master kind, at a plausible term
            pulse_subject(OTHER),  # another node's pulse
            f"$KV.{STATE_BUCKET}.snapshot", f"$KV.{LEADER_BUCKET}.leader",  # the snapshot, the lease
            command_subject("place_instance"), f"$O.exo-images.C.{uuid.uuid4().hex}",
            f"$JS.API.STREAM.DELETE.{EVENTS_STREAM}", f"$JS.API.STREAM.PURGE.{EVENTS_STREAM}",
            f"$JS.API.STREAM.UPDATE.{EVENTS_STREAM}",
            f"$JS.API.CONSUMER.MSG.NEXT.{COMMANDS_STREAM}.{MASTER_CONSUMER}",
            f"$JS.API.CONSUMER.CREATE.{COMMANDS_STREAM}",  # the legacy form could replace the master's consumer
        ], subscriptions=[
            model_share_subject(OTHER, "manifest"), download_control_subject(OTHER, "delete"),  # answering for another
            "$JS.API.>",  # answering for the server
        ])
        assert await last_seqs(server.admin.jetstream()) == before
        await eventually(lambda: pulses, timeout=5)
        assert pulses == [pulse_subject(WORKER)]
    finally:
        await worker.close()


async def test_a_master_candidate_writes_the_master_kinds_the_snapshot_and_the_lease(server: Server):
    refusals: list[str] = []
    master = await as_node(server, "master", refusals)
    try:
        deleted = InstanceDeleted(instance_id=InstanceId("gone"), reason="test", term=1)
        seq = await EventLog(master).append(deleted, uuid.uuid4().hex)
        stored = await server.admin.jetstream().get_msg(EVENTS_STREAM, seq)
        assert stored.subject == event_subject("instance.deleted")
        assert msgspec.json.decode(stored.data or b"")["kind"] == "instance.deleted"
        assert await Lease(master, MASTER).try_acquire() is not None
        view, _ = await catch_up(master)
        assert await write_snapshot(master, view.state)
        assert await read_latest_snapshot(server.admin) == view.state
        await view.stop()
        await master.flush()
        assert refusals == []
    finally:
        await master.close()


async def test_with_the_writer_in_the_subject_a_worker_cannot_write_as_another(server: Server):
    """The proposed subjects (exo/core/node_roles.py): the same worker, its events and chunks under
    its own node id, its replies under its own inbox."""
    refusals: list[str] = []
    prefix = PROPOSED.inbox_prefix(WORKER)
    worker = await as_node(server, "proposed-worker", refusals, inbox_prefix=prefix)
    try:
        assert worker.new_inbox().startswith(f"_INBOX.{WORKER}.")
        ack = await worker.jetstream().publish(f"exo.events.{WORKER}.node.heartbeat", encode_event(heartbeat(WORKER)))
        assert ack.stream == EVENTS_STREAM
        await worker.publish(f"exo.tokens.cmd1.{WORKER}", b"{}")
        await worker.publish(f"exo.cache.{WORKER}.i1", b"{}")
        await expect_refused(worker, refusals, publishes=[
            f"exo.events.{OTHER}.node.heartbeat", f"exo.tokens.cmd1.{OTHER}", f"exo.cache.{OTHER}.i1",
            event_subject("node.heartbeat"),  # today's subject, naming no writer
        ], subscriptions=[f"_INBOX.{OTHER}.>", "_INBOX.>"])
    finally:
        await worker.close()


def test_a_seed_file_others_can_read_or_that_is_no_user_seed_is_refused(tmp_path: Path):
    key = load_node_key(tmp_path)
    seed = key.seed_file.read_bytes().strip()
    assert os.stat(key.seed_file).st_mode & 0o777 == 0o600
    assert load_node_key(tmp_path) == key  # kept across starts
    assert bytes(nkeys.from_seed(seed).public_key).decode() == key.public_key  # nkeys' own derivation
    key.seed_file.chmod(0o644)
    with pytest.raises(NodeKeyError, match=f"{key.seed_file} has mode 0644"):
        load_node_key(tmp_path)
    key.seed_file.chmod(0o600)
    account_seed = nkeys.encode_seed(secrets.token_bytes(32), nkeys.PREFIX_BYTE_ACCOUNT)
    checksum_broken = seed[:-1] + (b"A" if seed[-1:] != b"A" else b"B")
    for content, said in ((account_seed, "an nkey seed of another kind"), (checksum_broken, "does not hold an nkey seed"),
                          (b"not a seed at all", "does not hold an nkey seed")):
        key.seed_file.write_bytes(content)
        with pytest.raises(NodeKeyError, match=said) as refused:
            load_node_key(tmp_path)
        assert content.decode() not in str(refused.value)  # a seed is never shown
    with pytest.raises(NodeKeyError, match="not a NATS user's public key"):
        check_public_key(seed.decode())
    with pytest.raises(NodeKeyError, match="not a NATS user's public key"):
        check_public_key(key.public_key[:-1] + ("A" if key.public_key[-1] != "A" else "B"))  # its checksum broken


def test_every_event_kind_has_a_writer_and_node_ids_cannot_widen_a_grant():
    every_kind = {str(kind.__struct_config__.tag) for kind in get_args(AnyEvent)}
    assert every_kind == kinds_written_by(Role)  # a new kind without a writer would be refused to everyone
    for bad in ("a.b", "*", ">", ""):
        with pytest.raises(ValueError, match="cannot name NATS subjects"):
            node_permissions(NodeId(bad), [Role.WORKER], TODAY)
    with pytest.raises(ValueError, match="not"):
        node_permissions(WORKER, [Role.OPERATOR], TODAY)


def _matches(pattern: str, subject: str) -> bool:
    """NATS's subject matching: `*` one token, `>` the rest."""
    wanted, given = pattern.split("."), subject.split(".")
    for i, token in enumerate(wanted):
        if token == ">":
            return len(given) > i
        if i >= len(given) or token not in ("*", given[i]):
            return False
    return len(wanted) == len(given)


def test_the_operator_role_grants_what_the_operator_user_has():
    derived = operator_permissions(TODAY)
    for direction, rules in (("publish", derived.publish), ("subscribe", derived.subscribe)):
        given = OPERATOR_PERMISSIONS[direction]
        assert set(rules.allow) == set(given["allow"])
        # the same subjects denied: each denial of one is covered by one of the other's
        assert all(any(_matches(mine, theirs) for mine in rules.deny) for theirs in given["deny"])
        assert all(any(_matches(theirs, mine) for theirs in given["deny"]) for mine in rules.deny)
