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
from exo.bus.event_log import EventLog
from exo.bus.images import store_image
from exo.bus.provision import provision
from exo.bus.server.embedded import EmbeddedNats
from exo.bus.snapshots import write_snapshot
from exo.core.commands import PlaceInstance
from exo.core.events import TaskStarted, decode_event, encode_event
from exo.core.state import State, encode_state
from exo.core.types import NodeInfo
from exo.resources import streams_dir
from tests.support.exo_process import ExoProcess, exo_command
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
    """What an operator's `nats` commands use: read-only (exo/bus/server/permissions.py)."""
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
    assert "ermissions violation" not in view  # its pager acks what it shows, on a consumer of its own
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


# `exo nats-context`: what docs/operations.md tells an operator to run first, on a real node.

@pytest.fixture(scope="module")
def exo_node(tmp_path_factory):
    node = ExoProcess(tmp_path_factory.mktemp("exo-node") / "data", {}, ["--no-worker"]).start()
    yield node
    node.interrupt()


def operator_env(config_home: Path, **extra: str) -> dict[str, str]:
    """An operator's shell: no NATS_* settings of its own, the CLI's contexts under `config_home`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("NATS_")}
    return {**env, "XDG_CONFIG_HOME": str(config_home), **extra}


def nats_context(env: dict[str, str], *args: str) -> str:
    done = subprocess.run([*exo_command(), "nats-context", *args], capture_output=True, text=True, env=env,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout


def as_operator(nats: str, env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([nats, "--timeout", "2s", *args], capture_output=True, text=True, env=env, timeout=30)


def test_nats_context_lets_the_cli_list_a_running_nodes_streams(nats_cli, exo_node, tmp_path: Path):
    env = operator_env(tmp_path / "config", EXO_HOME=str(exo_node.data_dir))
    said = nats_context(env)
    path = tmp_path / "config" / "nats" / "context" / "exo.json"
    assert f"to {path}" in said and "as user operator (read-only)" in said and "nats --context exo stream ls" in said
    assert os.stat(path).st_mode & 0o777 == 0o600  # it holds the operator's password
    saved = json.loads(path.read_text())
    assert (saved["user"], saved["url"]) == ("operator", exo_node.nats_url().replace(
        f"exo:{json.loads((exo_node.data_dir / 'nats' / 'credentials.json').read_text())['exo_password']}@", ""))
    listed = as_operator(nats_cli, env, "--context", "exo", "stream", "ls", "--names")
    assert listed.returncode == 0, listed.stderr
    assert {"EXO_EVENTS", "EXO_COMMANDS", "EXO_TOKENS"} <= set(listed.stdout.split())
    # Without the context the CLI is refused: the context is what made it work.
    bare = as_operator(nats_cli, env, "--server", saved["url"], "stream", "ls", "--names")
    assert bare.returncode != 0 and "Authorization Violation" in bare.stderr


def test_stream_view_through_the_context_pages_events_without_a_violation(nats_cli, exo_node, tmp_path: Path):
    env = operator_env(tmp_path / "config")
    nats_context(env, "--data-dir", str(exo_node.data_dir))
    view = in_a_terminal(["env", f"XDG_CONFIG_HOME={env['XDG_CONFIG_HOME']}", nats_cli, "--context", "exo",
                          "stream", "view", "EXO_EVENTS", "25"])
    assert "[1] Subject: exo.events.leader.elected Received: " in view, view  # the node's master took office
    assert '{"kind":"leader.elected",' in view, view
    assert "ermissions violation" not in view, view


def test_the_selected_context_reads_but_cannot_purge_or_send_a_command(nats_cli, exo_node, tmp_path: Path):
    env = operator_env(tmp_path / "config")
    said = nats_context(env, "--data-dir", str(exo_node.data_dir), "--name", "exo-ops", "--select")
    assert "next: nats stream ls" in said
    assert (tmp_path / "config" / "nats" / "context.txt").read_text() == "exo-ops"

    def counts() -> dict[str, int]:
        infos = [as_operator(nats_cli, env, "stream", "info", name, "--json")  # no --context: the selected one
                 for name in ("EXO_EVENTS", "EXO_COMMANDS")]
        assert all(info.returncode == 0 for info in infos), [info.stderr for info in infos]
        return {(got := json.loads(info.stdout))["config"]["name"]: got["state"]["last_seq"] for info in infos}

    before = counts()
    for args in (["stream", "purge", "EXO_EVENTS", "-f"], ["stream", "rm", "EXO_COMMANDS", "-f"],
                 ["pub", "exo.commands.place_instance", '{"kind":"place_instance","model_id":"org/m"}'],
                 ["pub", "exo.events.leader.elected", '{"kind":"leader.elected","node_id":"x"}']):
        done = as_operator(nats_cli, env, *args)
        assert "ermissions violation" in done.stderr.lower(), (args, done.stderr)
    assert counts() == before


async def test_the_operator_cannot_ack_the_masters_deliveries(nats_cli, fresh_nc, operator_url):
    """The operator may ack its own consumers' messages, not settle a command the master holds."""
    await send_command(fresh_nc, PlaceInstance(command_id="held", model_id="org/m"))
    master = await fresh_nc.jetstream().pull_subscribe_bind("exo-master", stream="EXO_COMMANDS")
    [held] = await master.fetch(1, timeout=5)  # delivered, not yet acked: what a deciding master holds
    for verdict in ("+ACK", "+TERM"):
        done = await in_thread(subprocess.run, [nats_cli, "--server", operator_url, "pub", held.reply, verdict],
                               capture_output=True, text=True, timeout=30)
        assert "ermissions violation" in done.stderr.lower(), done.stderr
    # (the CLI printed the server's refusal, so the server has handled its ack: nothing to wait for)
    info = await fresh_nc.jetstream().consumer_info("EXO_COMMANDS", "exo-master")
    assert (info.num_ack_pending, info.num_pending) == (1, 0)
