"""What an operator does with the real `nats` CLI (natscli v0.5.0) works on exo's streams.

The CLI is used when it is on PATH; with EXO_REQUIRE_NATS_CLI=1 (set by .ci/run, which installs
it) its absence fails these tests instead of skipping them.
"""

from __future__ import annotations

import asyncio
import json
import os
import pty
import select
import shutil
import subprocess
import time
import uuid
from pathlib import Path

import msgspec
import pytest

from exo.bus.command_queue import send_command
from exo.bus.connection import connect
from exo.bus.embedded import EmbeddedNats
from exo.bus.event_log import EventLog
from exo.bus.images import store_image
from exo.bus.provision import provision
from exo.bus.snapshots import write_snapshot
from exo.core.commands import PlaceInstance
from exo.core.events import TaskStarted, decode_event, encode_event
from exo.core.state import State, encode_state
from exo.core.types import NodeInfo
from exo.resources import streams_dir
from tests.support.exo_tools import SCRIPT, append_script, in_thread

pytestmark = pytest.mark.slow  # starts `nats` CLI processes


@pytest.fixture(scope="module")
def nats_cli() -> str:
    found = shutil.which("nats")
    if found:
        return found
    if os.environ.get("EXO_REQUIRE_NATS_CLI") == "1":
        pytest.fail("EXO_REQUIRE_NATS_CLI=1 but the `nats` CLI is not on PATH "
                    "(go install github.com/nats-io/natscli/nats@v0.5.0; add $(go env GOPATH)/bin to PATH)")
    pytest.skip("the `nats` CLI is not on PATH (set EXO_REQUIRE_NATS_CLI=1 to make this a failure)")


def cli(nats: str, url: str, *args: str, timeout: float = 30) -> subprocess.CompletedProcess:
    done = subprocess.run([nats, "--server", url, *args], capture_output=True, timeout=timeout)
    assert done.returncode == 0, f"nats {' '.join(args)}: {done.stderr.decode()}"
    return done


def cli_json(nats: str, url: str, *args: str) -> dict:
    return json.loads(cli(nats, url, *args, "--json").stdout)


def in_a_terminal(command: list[str], timeout: float = 30) -> str:
    """`nats stream view` pages interactively and refuses to run without a terminal."""
    leader, follower = pty.openpty()
    process = subprocess.Popen(command, stdin=follower, stdout=follower, stderr=follower, close_fds=True)
    os.close(follower)
    chunks, deadline = [], time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if select.select([leader], [], [], 0.1)[0]:
                try:
                    data = os.read(leader, 65536)
                except OSError:  # EIO: the process closed the terminal
                    break
                if not data:
                    break
                chunks.append(data)
            elif process.poll() is not None:
                break
    finally:
        process.kill() if process.poll() is None else None
        process.wait()
        os.close(leader)
    return b"".join(chunks).decode(errors="replace").replace("\r\n", "\n")


@pytest.fixture
def operator_url(fresh_server: EmbeddedNats) -> str:
    """What an operator's `nats` commands use: read-only (exo/bus/permissions.py)."""
    return fresh_server.operator_url


@pytest.fixture
async def fresh_nc(fresh_nats: str):
    client = await connect([fresh_nats], name="test-nats-cli")
    await provision(client)
    yield client
    await client.close()


async def test_stream_add_config_gives_exactly_what_exo_provisions(nats_cli, fresh_nats, tmp_path: Path):
    provisioned = await connect([fresh_nats], name="provisioned")
    await provision(provisioned)
    by_cli = EmbeddedNats(tmp_path / "by-cli", port=0)
    cli_url = await by_cli.start()
    try:
        files = sorted(streams_dir().glob("*.json"))
        names = [json.loads(f.read_text())["name"] for f in files]
        assert {"EXO_EVENTS", "EXO_COMMANDS", "EXO_TOKENS", "KV_exo-state", "OBJ_exo-images"} <= set(names)
        for file in files:
            await in_thread(cli, nats_cli, cli_url, "stream", "add", "--config", str(file))
        for file in sorted((streams_dir() / "consumers").glob("*.json")):
            stream = file.name.split(".", 1)[0]
            await in_thread(cli, nats_cli, cli_url, "consumer", "add", stream, "--config", str(file))
        for name in names:
            want = (await in_thread(cli_json, nats_cli, fresh_nats, "stream", "info", name))["config"]
            got = (await in_thread(cli_json, nats_cli, cli_url, "stream", "info", name))["config"]
            assert got == want, name
        want = (await in_thread(cli_json, nats_cli, fresh_nats, "consumer", "info", "EXO_COMMANDS", "exo-master"))
        got = (await in_thread(cli_json, nats_cli, cli_url, "consumer", "info", "EXO_COMMANDS", "exo-master"))
        assert got["config"] == want["config"]
        # And exo finds nothing to object to in what the CLI made (it refuses any other config).
        client = await connect([cli_url], name="exo-on-cli-streams")
        await provision(client)
        await client.close()
    finally:
        await provisioned.close()
        by_cli.stop()


async def test_stream_get_and_view_show_readable_json_events(nats_cli, fresh_nc, operator_url):
    await append_script(fresh_nc)
    got = (await in_thread(cli, nats_cli, operator_url, "stream", "get", "EXO_EVENTS", "4")).stdout.decode()
    assert "EXO_EVENTS#4" in got and "on Subject exo.events.task.created" in got
    assert "Nats-Msg-Id: " in got
    assert got.strip().splitlines()[-1] == encode_event(SCRIPT[3]).decode()

    view = await in_thread(in_a_terminal, [nats_cli, "--server", operator_url, "stream", "view", "EXO_EVENTS", "25"])
    assert "[4] Subject: exo.events.task.created Received: " in view
    bodies = [json.loads(line) for line in view.splitlines() if line.startswith('{"kind"')]
    assert bodies == [msgspec.to_builtins(e) for e in SCRIPT if e is not None]


async def test_nats_sub_sees_live_events(nats_cli, fresh_nc, operator_url):
    sub = subprocess.Popen([nats_cli, "--server", operator_url, "sub", "exo.events.>", "--count", "2", "--raw"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    sent = []
    try:
        # It only sees what is published after it subscribed, so keep publishing until it has two.
        for n in range(300):
            if sub.poll() is not None:
                break
            event = TaskStarted(task_id=f"live-{n}")
            await EventLog(fresh_nc).append(event, uuid.uuid4().hex)
            sent.append(event)
            await asyncio.sleep(0.05)
        out, err = await in_thread(sub.communicate, timeout=10)
    finally:
        sub.kill() if sub.poll() is None else None
    assert sub.returncode == 0, err
    seen = [decode_event(line) for line in out.splitlines() if line.strip()]
    assert len(seen) == 2
    first = sent.index(seen[0])
    assert seen == sent[first:first + 2]


async def test_kv_get_returns_the_snapshot(nats_cli, fresh_nc, operator_url):
    state = State(last_seq=7, nodes={"n1": NodeInfo(node_id="n1", hostname="alpha")})
    assert await write_snapshot(fresh_nc, state)
    got = await in_thread(cli, nats_cli, operator_url, "kv", "get", "exo-state", "snapshot", "--raw")
    assert got.stdout == encode_state(state)


async def test_object_ls_and_get_the_images(nats_cli, fresh_nc, operator_url, tmp_path: Path):
    image = b"\x89PNG\r\n not really an image" * 100
    digest, _ = await store_image(fresh_nc, image)
    listed = await in_thread(cli, nats_cli, operator_url, "object", "ls", "exo-images")
    assert digest in listed.stdout.decode()
    target = tmp_path / "image.bin"
    await in_thread(cli, nats_cli, operator_url, "object", "get", "exo-images", digest, "--output", str(target),
                    "--no-progress", "--force")
    assert target.read_bytes() == image


async def test_consumer_info_shows_the_masters_consumer_and_its_backlog(nats_cli, fresh_nc, operator_url):
    await send_command(fresh_nc, PlaceInstance(command_id="queued", model_id="org/m"))
    info = await in_thread(cli_json, nats_cli, operator_url, "consumer", "info", "EXO_COMMANDS", "exo-master")
    assert info["config"]["durable_name"] == "exo-master" and info["config"]["ack_policy"] == "explicit"
    assert (info["num_pending"], info["num_ack_pending"]) == (1, 0)


async def test_the_operator_cannot_change_anything_with_the_cli(nats_cli, fresh_nc, operator_url):
    await append_script(fresh_nc)
    before = await fresh_nc.jetstream().stream_info("EXO_EVENTS")
    for args in (["stream", "rm", "EXO_EVENTS", "-f"], ["stream", "purge", "EXO_EVENTS", "-f"],
                 ["kv", "put", "exo-state", "snapshot", "{}"], ["consumer", "rm", "EXO_COMMANDS", "exo-master", "-f"],
                 ["request", "exo.events.leader.elected", '{"kind":"leader.elected","node_id":"x"}']):
        done = await in_thread(subprocess.run, [nats_cli, "--server", operator_url, "--timeout", "2s", *args],
                               capture_output=True, timeout=30)
        assert b"ermissions violation" in done.stderr.lower(), (args, done.stderr)  # `nats request` exits 0 even so
    after = await fresh_nc.jetstream().stream_info("EXO_EVENTS")
    assert after.state.last_seq == before.state.last_seq
    assert (await fresh_nc.jetstream().consumer_info("EXO_COMMANDS", "exo-master")).name == "exo-master"
