"""The bus against a real nats-server: provisioning, the event log, the master's command loop."""

from __future__ import annotations

import asyncio
import json

import pytest

from exo.bus.command_queue import send_command
from exo.bus.connection import connect
from exo.bus.errors import BusError, ConfigMismatch
from exo.bus.event_log import EventLog
from exo.bus.provision import provision, stream_configs
from exo.bus.state_view import StateView
from exo.core.commands import GenerateText, PlaceInstance
from exo.core.events import CommandRejected, InstanceCreated, LeaderElected, NodeRegistered, TaskStarted
from exo.core.types import ModelCard, NodeInfo
from exo.master.service import Master
from exo.settings.services import MasterSettings
from tests.conftest import eventually


async def test_provisioning_is_idempotent_and_matches_the_files(nc):
    await provision(nc)  # a second time: nothing changes, nothing fails
    js = nc.jetstream()
    for config in stream_configs():
        info = await js.stream_info(config["name"])
        assert info.config.subjects == config["subjects"]
        assert info.config.storage == config["storage"]
    consumer = await js.consumer_info("EXO_COMMANDS", "exo-master")
    assert consumer.config.ack_policy == "explicit"


async def test_an_existing_stream_with_another_config_is_an_error_not_overwritten(fresh_nats):
    client = await connect([fresh_nats], name="t")
    try:
        config = next(c for c in stream_configs() if c["name"] == "EXO_TOKENS")
        changed = {**config, "max_bytes": 1024 * 1024}
        await client.request("$JS.API.STREAM.CREATE.EXO_TOKENS", json.dumps(changed).encode())
        with pytest.raises(ConfigMismatch, match="EXO_TOKENS"):
            await provision(client)
        info = await client.jetstream().stream_info("EXO_TOKENS")
        assert info.config.max_bytes == 1024 * 1024  # untouched
    finally:
        await client.close()


async def test_a_bad_url_fails_fast_with_a_clear_error():
    with pytest.raises(BusError, match="cannot connect to NATS at nats://127.0.0.1:1"):
        await asyncio.wait_for(connect(["nats://127.0.0.1:1"], name="t"), 10)


async def test_events_are_indexed_by_stream_sequence_and_deduplicated(nc):
    log = EventLog(nc)
    first = await log.append(TaskStarted(task_id="a"), event_id="dedupe-1")
    again = await log.append(TaskStarted(task_id="a"), event_id="dedupe-1")
    second = await log.append(TaskStarted(task_id="b"), event_id="dedupe-2")
    assert again == first and second == first + 1
    msg = await nc.jetstream().get_msg("EXO_EVENTS", first)
    assert msg.subject == "exo.events.task.started"
    assert json.loads(msg.data) == {"kind": "task.started", "term": 0, "task_id": "a", "attempt": 0}
    assert msg.headers["Nats-Msg-Id"] == "dedupe-1"


async def test_a_view_folds_the_whole_log_in_order(nc):
    log = EventLog(nc)
    seq = await log.append(NodeRegistered(node=NodeInfo(node_id="fold-test")), event_id="fold-1")
    view = StateView(nc)
    await view.start()
    state = await view.wait_for(seq)
    assert "fold-test" in state.nodes
    await view.stop()


async def view_with_a_node(nc, node_id: str) -> tuple[StateView, dict[str, list]]:
    """A caught-up view, the events it folds by command id from now on, and a node to place on."""
    view = StateView(nc)
    await view.start()
    await view.wait_for(await EventLog(nc).last_sequence())
    answers: dict[str, list] = {}
    view.add_listener(lambda seq, event, state: answers.setdefault(getattr(event, "command_id", ""), []).append(event))
    await EventLog(nc).append(NodeRegistered(node=NodeInfo(node_id=node_id, memory_available=10**12)), f"{node_id}-node")
    return view, answers


async def placed_then_waiting(nc, node: str, builtin: dict[str, ModelCard], commands: list[GenerateText]):
    """A view, its answers, and an instance of org/m placed by a master that then stopped, with
    `commands` queued for the next master."""
    view, answers = await view_with_a_node(nc, node)
    # The node has no worker to pulse: a master that suspects it (EXO_SUSPECT_S, 5 s) refuses the commands
    # queued here, and a loaded machine can take that long (a fast lane beside other work did).
    first = asyncio.create_task(Master(nc, view, builtin, node_id=node, settings=MasterSettings(suspect_s=600.0)).run())
    try:
        await send_command(nc, PlaceInstance(command_id=f"{node}-place", model_id="org/m"))
        await eventually(lambda: f"{node}-place" in answers, 20)
    finally:
        first.cancel()
        await asyncio.wait({first}, timeout=10)
    for command in commands:
        await send_command(nc, command)
    return view, answers


async def test_master_answers_commands_with_events_and_a_redelivery_decides_the_same(nc):
    view, answers = await view_with_a_node(nc, "master-test")
    builtin = {"org/m": ModelCard(model_id="org/m", n_layers=2, storage_bytes=1000)}
    master = Master(nc, view, builtin, node_id="master-test")
    running = asyncio.create_task(master.run())
    try:
        await send_command(nc, PlaceInstance(command_id="mt-1", model_id="org/m"))
        await send_command(nc, PlaceInstance(command_id="mt-2", model_id="org/unknown"))
        await eventually(lambda: "mt-1" in answers and "mt-2" in answers, 10, what="answers to mt-1 and mt-2")
        created, rejected = answers["mt-1"][0], answers["mt-2"][0]
        assert isinstance(created, InstanceCreated) and created.instance.model_id == "org/m"
        assert isinstance(rejected, CommandRejected) and rejected.code == "not_found"
        before = view.state.last_seq
        await master.handle(PlaceInstance(command_id="mt-1", model_id="org/m"))  # as if redelivered
        assert view.state.last_seq == before  # same event id, deduplicated by the server
    finally:
        running.cancel()
        await asyncio.wait({running}, timeout=10)  # teardown must not hang the suite
        await view.stop()


async def test_waiting_commands_are_decided_in_one_batch_each_on_the_events_of_those_before(fresh_nats):
    """Ten requests wait while no master runs; the next takes them in one batch (one confirm, one
    ack round) and still admits exactly max_queue of them: each decision saw the ones before."""
    nc = await connect([fresh_nats], name="batch-test")
    await provision(nc)
    builtin = {"org/m": ModelCard(model_id="org/m", n_layers=2, storage_bytes=1000)}
    view, answers = await placed_then_waiting(nc, "batch-test", builtin,
                                              [GenerateText(command_id=f"batch-{n}", model_id="org/m") for n in range(10)])
    confirms: list[int] = []

    class Counting(Master):
        async def confirm(self) -> None:
            confirms.append(len(answers))
            await super().confirm()

    async def slow_fold(seq, event, state) -> None:
        await asyncio.sleep(0.05)  # the view lags the log: decisions must not wait for it, nor miss their own events

    view.add_listener(slow_fold)
    running = asyncio.create_task(Counting(nc, view, builtin, node_id="batch-test", settings=MasterSettings(max_queue=3)).run())
    try:
        await eventually(lambda: all(f"batch-{n}" in answers for n in range(10)), 20)
        outcomes = [answers[f"batch-{n}"][0] for n in range(10)]
        assert [type(e).__name__ for e in outcomes] == ["TaskCreated"] * 3 + ["CommandRejected"] * 7
        assert all(e.code == "overloaded" for e in outcomes[3:])
        assert len(confirms) == 1
    finally:
        running.cancel()
        await asyncio.wait({running}, timeout=10)
        await view.stop()
        await nc.close()


async def test_snapshots_never_go_backwards(fresh_nats):
    from exo.bus.snapshots import read_latest_snapshot, snapshot_history, write_snapshot
    from exo.core.state import State

    client = await connect([fresh_nats], name="t")
    try:
        await provision(client)
        assert await read_latest_snapshot(client) is None and await snapshot_history(client) == []
        for n in range(9):  # a snapshot covers events the log has: none beyond its last sequence
            await EventLog(client).append(TaskStarted(task_id=f"t{n}"), f"e{n}")
        assert await write_snapshot(client, State(last_seq=5))
        assert await write_snapshot(client, State(last_seq=9))
        assert not await write_snapshot(client, State(last_seq=7))  # older: refused
        assert (await read_latest_snapshot(client)).last_seq == 9
        assert [s.last_seq for s in await snapshot_history(client)] == [5, 9]
    finally:
        await client.close()


async def test_images_are_stored_once_by_hash_and_fetched_verified(nc):
    import os

    from exo.bus.images import ImageMissing, fetch_image, image_digest, store_image

    data = os.urandom(3 * 128 * 1024 + 17)  # several chunks and a partial one
    digest, uploaded = await store_image(nc, data)
    assert digest == image_digest(data) and uploaded
    assert await store_image(nc, data) == (digest, False)  # the second send skips the upload
    assert await fetch_image(nc, digest) == data
    with pytest.raises(ImageMissing):
        await fetch_image(nc, "0" * 64)


async def test_a_full_image_store_refuses_an_image_whole_and_keeps_nothing_of_it(fresh_nats):
    import os

    from exo.bus.images import ImageStoreFull, store_image
    from exo.bus.subjects import IMAGES_STREAM

    client = await connect([fresh_nats], name="t")
    try:
        await provision(client, overrides={IMAGES_STREAM: {"max_bytes": 600_000}})
        kept = os.urandom(300_000)
        await store_image(client, kept)
        used = (await client.jetstream().stream_info(IMAGES_STREAM)).state.bytes
        with pytest.raises(ImageStoreFull, match="the image store is full"):
            await store_image(client, os.urandom(400_000))  # its first chunks fit, the rest do not
        assert (await client.jetstream().stream_info(IMAGES_STREAM)).state.bytes == used
    finally:
        await client.close()


async def test_a_stream_as_an_earlier_release_made_it_is_updated_and_one_an_operator_tuned_is_not(fresh_nats):
    from exo.bus.subjects import IMAGES_STREAM

    client = await connect([fresh_nats], name="t")
    try:
        config = next(c for c in stream_configs() if c["name"] == IMAGES_STREAM)
        assert config["max_bytes"] > 0
        await client.request(f"$JS.API.STREAM.CREATE.{IMAGES_STREAM}", json.dumps({**config, "max_bytes": -1}).encode())
        await provision(client)  # unbounded, as releases before the limit made it
        assert (await client.jetstream().stream_info(IMAGES_STREAM)).config.max_bytes == config["max_bytes"]
        tuned = {**config, "max_bytes": 123_456_789}
        await client.request(f"$JS.API.STREAM.UPDATE.{IMAGES_STREAM}", json.dumps(tuned).encode())
        with pytest.raises(ConfigMismatch, match=IMAGES_STREAM):
            await provision(client)
        assert (await client.jetstream().stream_info(IMAGES_STREAM)).config.max_bytes == 123_456_789
    finally:
        await client.close()


async def test_catch_up_starts_from_the_snapshot_and_says_clearly_when_the_log_was_trimmed_past_it(fresh_nats):
    from exo.bus.catch_up import catch_up
    from exo.bus.errors import LogGap
    from exo.bus.snapshots import write_snapshot
    from exo.core.apply import apply
    from exo.core.state import State

    client = await connect([fresh_nats], name="t")
    try:
        await provision(client)
        log, state = EventLog(client), State()
        for n in range(100):
            event = NodeRegistered(node=NodeInfo(node_id=f"n{n % 5}", memory_available=n))
            state = apply(state, event, await log.append(event, f"e{n}"))
            if n == 94:
                at_95 = state
        await client.jetstream().purge_stream("EXO_EVENTS", keep=10)  # history before 91 is gone
        with pytest.raises(LogGap, match="starts at sequence 91 but this reader needs 1"):
            await catch_up(client)
        # An unsigned snapshot, usable while the log shows a leader without a key (an older master).
        elected = LeaderElected(node_id="old", lease_revision=1)
        state = apply(state, elected, await log.append(elected, "elected"))
        await write_snapshot(client, at_95)
        view, from_seq = await catch_up(client)
        assert from_seq == 95 and view.state == state
        await view.stop()
    finally:
        await client.close()


async def test_a_snapshot_of_ten_thousand_tasks_and_a_hundred_nodes_round_trips(fresh_nats):
    from exo.bus.snapshots import read_latest_snapshot, write_snapshot
    from exo.core.requests import ChatMessage, GenerationParams
    from exo.core.state import State
    from exo.core.types import Task

    params = GenerationParams(messages=[ChatMessage(role="user", content="a question of some length " * 4)])
    tasks = {f"t{n}": Task(task_id=f"t{n}", instance_id="i", model_id="org/m", params=params) for n in range(10_000)}
    nodes = {f"n{n}": NodeInfo(node_id=f"n{n}", memory_total=n) for n in range(100)}
    big = State(last_seq=3, tasks=tasks, nodes=nodes)
    client = await connect([fresh_nats], name="t")
    try:
        await provision(client)
        for n in range(3):  # the log reaches the snapshot's sequence
            await EventLog(client).append(TaskStarted(task_id=f"t{n}"), f"e{n}")
        assert await write_snapshot(client, big)
        assert await read_latest_snapshot(client) == big
    finally:
        await client.close()


async def test_a_command_whose_handling_keeps_failing_is_answered_once_not_looped(fresh_nats):
    from exo.bus.command_queue import MAX_COMMAND_ATTEMPTS

    nc = await connect([fresh_nats], name="poison-test")
    await provision(nc)
    view, answers = await view_with_a_node(nc, "poison-test")
    attempts: list[str] = []

    class Buggy(Master):
        async def handle(self, command) -> None:
            attempts.append(command.command_id)
            if command.command_id == "poison":
                raise RuntimeError("a bug in the master")
            await super().handle(command)

    master = Buggy(nc, view, {"org/m": ModelCard(model_id="org/m", n_layers=2, storage_bytes=1000)}, node_id="poison-test")
    running = asyncio.create_task(master.run())
    try:
        await send_command(nc, PlaceInstance(command_id="poison", model_id="org/m"))
        await send_command(nc, PlaceInstance(command_id="after", model_id="org/m"))
        await eventually(lambda: "poison" in answers and "after" in answers, 10, what="answers to poison and after")
        (rejected,) = answers["poison"]
        assert isinstance(rejected, CommandRejected) and rejected.code == "unavailable"
        assert rejected.reason == "the master could not handle this command: RuntimeError: a bug in the master"
        assert isinstance(answers["after"][0], InstanceCreated)  # the queue moved on
        await asyncio.sleep(2.5)  # longer than the retry delay: no further delivery
        assert attempts.count("poison") == MAX_COMMAND_ATTEMPTS
    finally:
        running.cancel()
        await asyncio.wait({running}, timeout=10)
        await view.stop()
        await nc.close()
