"""`exo inspect`, `replay` and `events` find NATS as the node does: --nats / EXO_NATS_URL, else the
embedded server of the data dir (--data-dir / EXO_HOME / ~/.exo), as its read-only operator; and
when they cannot connect, they say which URL they tried, where it came from and why. The data dir
is laid out as a node's: `fresh_server` runs its nats-server in `<tmp_path>/nats`."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import uuid
from pathlib import Path

import pytest

from exo.bus.connection import connect
from exo.bus.event_log import EventLog
from exo.bus.provision import provision
from exo.bus.server.embedded import EmbeddedNats, load_credentials
from exo.core.events import TaskStarted
from tests.support.exo_process import exo_command, free_port
from tests.support.exo_tools import in_thread, json_lines

pytestmark = pytest.mark.slow  # starts tool processes

NO_SERVERS = "nats: no servers available for connection"


def tool(args: list[str], **env: str) -> subprocess.CompletedProcess[str]:
    """`exo ARGS` with only the NATS settings given here: none from this test's environment."""
    clean = {k: v for k, v in os.environ.items() if k not in ("EXO_NATS_URL", "EXO_HOME")}
    return subprocess.run([*exo_command(), *args], capture_output=True, text=True, timeout=60, env={**clean, **env})


@pytest.fixture
async def data_dir(fresh_server: EmbeddedNats, tmp_path: Path) -> Path:
    """A node's data dir whose server holds three events."""
    nc = await connect([fresh_server.url], name="test-data-dir")
    await provision(nc)
    for n in range(3):
        await EventLog(nc).append(TaskStarted(task_id=f"t{n}"), uuid.uuid4().hex)
    await nc.close()
    return tmp_path


async def test_each_tool_reads_the_url_and_the_operator_credentials_from_the_data_dir(
        fresh_server: EmbeddedNats, data_dir: Path):
    inspected = await in_thread(tool, ["inspect", "--json", "--data-dir", str(data_dir)])
    assert inspected.returncode == 0, inspected.stderr
    report = json.loads(inspected.stdout)
    assert report["server"]["url"] == fresh_server.address
    assert [s["messages"] for s in report["streams"] if s["name"] == "EXO_EVENTS"] == [3]
    exported = await in_thread(tool, ["events", "export", "--data-dir", str(data_dir)])
    assert exported.returncode == 0, exported.stderr
    assert [line["seq"] for line in json_lines(exported.stdout)] == [1, 2, 3]
    replayed = await in_thread(tool, ["replay", "--json"], EXO_HOME=str(data_dir))  # EXO_HOME, as the node
    assert replayed.returncode == 0, replayed.stderr
    assert json_lines(replayed.stdout)[-1]["state"]["last_seq"] == 3


async def test_a_url_given_wins_over_the_data_dir_and_its_failure_names_where_it_came_from(data_dir: Path):
    closed = f"nats://127.0.0.1:{free_port()}"
    flag = await in_thread(tool, ["replay", "--nats", closed, "--data-dir", str(data_dir)])
    assert (flag.returncode, flag.stderr) == (2, f"exo replay: cannot connect to NATS at {closed} (from --nats): {NO_SERVERS}\n")
    env = await in_thread(tool, ["events", "tail", "--data-dir", str(data_dir)], EXO_NATS_URL=closed)
    assert (env.returncode, env.stderr) == (2, f"exo events: cannot connect to NATS at {closed} (from EXO_NATS_URL): "
                                               f"{NO_SERVERS}\n")


async def test_credentials_the_server_refuses_are_named_with_their_data_dir_and_never_printed(
        fresh_server: EmbeddedNats, tmp_path: Path):
    other = tmp_path / "other-node"  # finds the live server, but holds another node's passwords
    shutil.copytree(tmp_path / "nats" / "ports", other / "nats" / "ports")
    password = load_credentials(other / "nats").operator_password
    done = await in_thread(tool, ["inspect", "--data-dir", str(other)])
    assert (done.returncode, done.stderr) == (
        2, f"exo inspect: cannot connect to NATS at {fresh_server.address} (from data dir {other}): "
           "nats: 'Authorization Violation'\n")
    assert password not in done.stderr + done.stdout


async def test_a_data_dir_without_a_live_node_says_so(tmp_path: Path):
    with socket.socket() as probe:
        if probe.connect_ex(("127.0.0.1", 4222)) == 0:
            pytest.skip("something listens on 4222, where a tool without a node falls back to")
    never = await in_thread(tool, ["inspect", "--data-dir", str(tmp_path / "never")])
    assert (never.returncode, never.stderr) == (
        2, f"exo inspect: cannot connect to NATS at nats://127.0.0.1:4222 (from data dir {tmp_path / 'never'}: "
           f"no node has run there): {NO_SERVERS}\n")
    load_credentials(tmp_path / "stopped" / "nats")  # a node ran here once; no server runs now
    stopped = await in_thread(tool, ["events", "export"], EXO_HOME=str(tmp_path / "stopped"))
    assert (stopped.returncode, stopped.stderr) == (
        2, f"exo events: cannot connect to NATS at nats://127.0.0.1:4222 (from data dir {tmp_path / 'stopped'}: "
           f"no live server in its nats/ports): {NO_SERVERS}\n")
