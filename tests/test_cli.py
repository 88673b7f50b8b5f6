"""`exo` as a user runs it: --help with the subcommands and defaults, --version, one clear line
naming the fix and a non-zero exit for what it cannot use, joining an existing NATS without starting
its own, and Ctrl-C twice."""

from __future__ import annotations

import socket
import subprocess
import time
from importlib import metadata
from pathlib import Path

import httpx
import pytest

from exo.bus.connection import redact
from exo.tools import TOOLS
from tests.support.cluster import wait_until
from tests.support.exo_process import ExoProcess, exo_command

pytestmark = pytest.mark.slow


def run_exo(args: list[str], timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run([*exo_command(), *args], capture_output=True, text=True, timeout=timeout)


def test_help_lists_every_subcommand_and_the_defaults():
    result = run_exo(["--help"])
    assert result.returncode == 0
    listed = " ".join(result.stdout.split())  # argparse wraps the lines
    shown = {"replay": "rebuild State from the event log with the reducer every node uses",
             "events": "the event log as an operator reads it",
             "inspect": "what NATS holds for exo, for machines without the `nats` CLI",
             "nats-context": "a `nats` CLI context for this machine's node, as its read-only operator",
             "keys": "create, list and delete API keys and read their usage, through a node's API",
             "node": "list the cluster's nodes, or remove one, through a node's API",
             "token": "join tokens, through a node's API: how a new machine joins a cluster with a secret"}
    assert set(shown) == set(TOOLS)  # a new tool gets its line here too
    for name, summary in shown.items():
        assert f"{name} {summary}" in listed, (name, summary)
    for default in ("(env EXO_API_PORT; default: 52415)", "(env EXO_NATS_PORT; default: 4222)",
                    "(env EXO_HOME; default: ~/.exo)", "none: 0.0.0.0", "(env EXO_LOG_LEVEL; default: INFO)"):
        assert default in " ".join(result.stdout.split()), default


def test_version_prints_the_package_version_and_exits_0():
    result = run_exo(["--version"])
    assert (result.returncode, result.stdout.strip()) == (0, f"exo {metadata.version('exo-jetstream')}")


def test_a_subcommand_keeps_its_own_options_and_one_after_node_options_names_the_fix():
    own = run_exo(["inspect", "--help"])
    assert own.returncode == 0 and own.stdout.startswith("usage: exo inspect")
    late = run_exo(["--log-level", "DEBUG", "inspect"])
    assert late.returncode == 2 and "put `inspect` first" in late.stderr
    unknown = run_exo(["inspekt"])
    assert unknown.returncode == 2 and "invalid choice: 'inspekt'" in unknown.stderr


def test_a_port_in_use_is_one_line_naming_the_flag_and_a_non_zero_exit(tmp_path: Path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run_exo(["--data-dir", str(tmp_path), "--host", "127.0.0.1", "--api-port", str(port), "--nats-port", "0"])
    assert result.returncode != 0
    assert result.stderr.strip().splitlines() == [
        f"exo: cannot listen on 127.0.0.1:{port}: Address already in use (another exo on this machine?); "
        f"pass another --api-port (or stop what uses it)"]


def test_an_unusable_nats_url_is_one_line_and_a_non_zero_exit(tmp_path: Path):
    result = run_exo(["--data-dir", str(tmp_path), "--nats", "nats://127.0.0.1:1", "--api-port", "0"])
    assert result.returncode != 0
    (line,) = [text for text in result.stderr.splitlines() if text.startswith("exo:")]
    assert line.startswith("exo: cannot connect to NATS at nats://127.0.0.1:1")
    assert not (tmp_path / "nats").exists()  # no embedded server was started


def test_joining_an_existing_nats_starts_no_server_of_its_own(tmp_path: Path, nats_url: str):
    exo = ExoProcess(tmp_path / "data", {}, ["--nats", nats_url]).start()
    try:
        assert f"NATS at {redact(nats_url)}" in exo.output()
        password = nats_url.split("@")[0].rsplit(":", 1)[1]
        assert password not in exo.output()  # logs never show it
        assert httpx.get(f"{exo.url}/health").json()["nats_connected"] is True
        assert not (tmp_path / "data" / "nats").exists()
    finally:
        assert exo.interrupt() == 0


def test_a_second_ctrl_c_exits_at_once(tmp_path: Path):
    exo = ExoProcess(tmp_path / "data", {}).start()
    exo.process.send_signal(2)
    # A second signal sent before the first is delivered merges with it (one pending SIGINT): wait for the first.
    wait_until(lambda: "exo: stopping" in exo.output(), 10, 0.01, what="the first SIGINT heard")
    exo.process.send_signal(2)
    started = time.monotonic()
    code = exo.process.wait(10)
    assert code == 130 and time.monotonic() - started < 5
