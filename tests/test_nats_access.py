"""The embedded nats-server admits only its credentials: a stray client cannot connect, and the
read-only `operator` reads everything exo's tools read and writes nothing (exo/bus/server/permissions.py)."""

from __future__ import annotations

import os
import uuid

import nats
import pytest

from exo.bus.catch_up import catch_up
from exo.bus.command_queue import send_command
from exo.bus.connection import connect
from exo.bus.errors import BusError
from exo.bus.event_log import EventLog
from exo.bus.images import fetch_image, store_image
from exo.bus.provision import provision
from exo.bus.server.embedded import EmbeddedNats, with_user
from exo.bus.server.permissions import EXO_USER
from exo.bus.snapshots import read_latest_snapshot, write_snapshot
from exo.bus.subjects import COMMANDS_STREAM, EVENTS_STREAM, IMAGES_STREAM, MASTER_CONSUMER, TOKENS_STREAM
from exo.core.commands import PlaceInstance
from exo.core.events import TaskStarted
from tests.conftest import eventually


async def test_a_client_without_credentials_or_with_wrong_ones_cannot_connect(fresh_server: EmbeddedNats):
    for url in (fresh_server.address, with_user(fresh_server.address, EXO_USER, "guessed")):
        with pytest.raises(BusError, match="Authorization Violation"):
            await connect([url], name="stranger")


def test_the_credentials_are_readable_by_their_owner_only(fresh_server: EmbeddedNats):
    for name in ("credentials.json", "nats-server.conf"):
        assert os.stat(fresh_server.store_dir / name).st_mode & 0o777 == 0o600, name


async def _counts(js) -> dict[str, int]:
    streams = (EVENTS_STREAM, COMMANDS_STREAM, TOKENS_STREAM, IMAGES_STREAM, "KV_exo-state")
    return {name: (await js.stream_info(name)).state.last_seq for name in streams}


# What a careless or hostile operator's client might send, each a write of some kind.
WRITES = [
    "exo.events.leader.elected", "exo.commands.place_instance", "exo.tokens.someone", "$KV.exo-state.snapshot",
    "$O.exo-images.C.forged", "$JS.API.STREAM.DELETE.EXO_EVENTS", "$JS.API.STREAM.PURGE.EXO_EVENTS",
    "$JS.API.STREAM.UPDATE.EXO_EVENTS", "$JS.API.STREAM.MSG.DELETE.EXO_EVENTS",
    f"$JS.API.CONSUMER.DELETE.{COMMANDS_STREAM}.{MASTER_CONSUMER}",
    f"$JS.API.CONSUMER.CREATE.{COMMANDS_STREAM}.{MASTER_CONSUMER}",
    f"$JS.API.CONSUMER.CREATE.{COMMANDS_STREAM}",  # the legacy form: the consumer's name is in the body
    f"$JS.API.CONSUMER.MSG.NEXT.{COMMANDS_STREAM}.{MASTER_CONSUMER}",
]


async def test_the_operator_reads_everything_and_changes_nothing(fresh_server: EmbeddedNats):
    exo = await connect([fresh_server.url], name="exo")
    await provision(exo)
    await EventLog(exo).append(TaskStarted(task_id="t1"), uuid.uuid4().hex)
    await send_command(exo, PlaceInstance(command_id="queued", model_id="org/m"))
    digest, _ = await store_image(exo, b"image bytes" * 1000)
    view, _ = await catch_up(exo)
    assert await write_snapshot(exo, view.state)
    before = await _counts(exo.jetstream())

    violations: list[str] = []

    async def on_error(error: Exception) -> None:
        violations.append(str(error))

    operator = await nats.connect(fresh_server.operator_url, error_cb=on_error, max_reconnect_attempts=-1)
    try:
        # Reads: the log from the start, the snapshot, an image, the master's backlog.
        read_view, _ = await catch_up(operator, use_snapshot=False)
        assert read_view.state == view.state
        assert await read_latest_snapshot(operator) == view.state
        assert await fetch_image(operator, digest) == b"image bytes" * 1000
        backlog = await operator.jetstream().consumer_info(COMMANDS_STREAM, MASTER_CONSUMER)
        assert backlog.num_pending == 1
        # Writes: each one refused by the server, and nothing changed.
        for subject in WRITES:
            await operator.publish(subject, b'{"kind":"leader.elected","node_id":"x"}', reply=operator.new_inbox())
        await operator.flush()
        # the server's refusals arrive as asynchronous errors: wait for them, then count exactly
        refused = lambda: [v for v in violations if "permissions violation for publish" in v.lower()]  # noqa: E731
        await eventually(lambda: len(refused()) >= len(WRITES), timeout=10)
        assert len(refused()) == len(WRITES), violations
        await operator.subscribe("$JS.API.>")  # to answer JetStream's requests in the server's place
        await operator.subscribe("exo.models.>")  # to serve forged model files to peers
        await operator.flush()
        subscriptions = lambda: sum("permissions violation for subscription" in v.lower() for v in violations)  # noqa: E731
        await eventually(lambda: subscriptions() >= 2, timeout=10)
        assert subscriptions() == 2, violations
        assert await _counts(exo.jetstream()) == before
        still = await exo.jetstream().consumer_info(COMMANDS_STREAM, MASTER_CONSUMER)
        assert (still.num_pending, still.num_ack_pending) == (1, 0)
    finally:
        await operator.close()
        await exo.close()


def test_the_deploy_docs_give_exactly_the_embedded_servers_permissions():
    from exo.bus.server.permissions import authorization_block
    from exo.resources import streams_dir

    docs = (streams_dir().parent / "docs" / "deploy.md").read_text()
    assert authorization_block("EXO_PASSWORD", "OPERATOR_PASSWORD") in docs


async def test_the_operator_cannot_take_a_master_groups_commands_either(tmp_path):
    """A master group's master consumes EXO_COMMANDS_<group> through its own exo-master: the same
    denials, by wildcard for the named forms and per group (from the server's EXO_MASTER_GROUPS)
    for the legacy one. Reading the group's log still works."""
    from exo.bus.provision import provision_group
    from exo.bus.subjects import group_names

    server = EmbeddedNats(tmp_path / "nats", port=0, master_groups=["alpha"])
    await server.start()
    exo = await connect([server.url], name="exo")
    violations: list[str] = []

    async def on_error(error: Exception) -> None:
        violations.append(str(error))

    operator = await nats.connect(server.operator_url, error_cb=on_error, max_reconnect_attempts=-1)
    try:
        await provision(exo)
        names = group_names("alpha")
        await provision_group(exo, names)
        await send_command(exo, PlaceInstance(command_id="queued", model_id="org/m"), names)
        await EventLog(exo, names).append(TaskStarted(task_id="t1"), uuid.uuid4().hex)
        stream, master = names.commands_stream, MASTER_CONSUMER
        writes = [f"$JS.API.CONSUMER.CREATE.{stream}.{master}", f"$JS.API.CONSUMER.CREATE.{stream}.{master}.x",
                  f"$JS.API.CONSUMER.CREATE.{stream}", f"$JS.API.CONSUMER.DELETE.{stream}.{master}",
                  f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{master}", f"$JS.ACK.{stream}.{master}.1.1.1.1.1",
                  "exo.group.alpha.events.leader.elected", "exo.group.alpha.commands.generate_text"]
        for subject in writes:
            await operator.publish(subject, b'{"stream_name":"x","config":{"name":"exo-master"}}', reply=operator.new_inbox())
        await operator.flush()
        refused = lambda: [v for v in violations if "permissions violation for publish" in v.lower()]  # noqa: E731
        await eventually(lambda: len(refused()) >= len(writes), timeout=10)
        assert len(refused()) == len(writes), violations
        read, _ = await catch_up(operator, use_snapshot=False, names=names)  # the group's log, read in order
        assert read.state.last_seq == 1 and read.state.group == "alpha"
        still = await exo.jetstream().consumer_info(stream, master)
        assert (still.num_pending, still.config.filter_subject) == (1, names.all_commands)
    finally:
        await operator.close()
        await exo.close()
        server.stop()
