"""`exo nats-context` without a node: the file it writes, and errors that name the cause and the fix.
With a node and the real `nats` CLI: tests/test_nats_cli.py."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from tests.support.exo_process import exo_command


def nats_context(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "XDG_CONFIG_HOME": str(tmp_path / "config"), "EXO_HOME": str(tmp_path / "no-node")}
    return subprocess.run([*exo_command(), "nats-context", *args], capture_output=True, text=True, env=env,
                          timeout=60)


def context_file(tmp_path: Path, name: str) -> Path:
    return tmp_path / "config" / "nats" / "context" / f"{name}.json"


def test_without_a_running_node_it_says_so_and_what_to_do(tmp_path: Path):
    done = nats_context(tmp_path)
    assert done.returncode == 2
    assert f"no exo node is running with data dir {tmp_path / 'no-node'}" in done.stderr
    assert "uv run exo" in done.stderr and "--data-dir" in done.stderr
    assert not (tmp_path / "config").exists()


def test_without_credentials_it_names_the_file_and_the_fix(tmp_path: Path):
    done = nats_context(tmp_path, "--nats", "nats://127.0.0.1:4222", "--data-dir", str(tmp_path / "empty"))
    assert done.returncode == 2
    assert f"{tmp_path / 'empty' / 'nats' / 'credentials.json'} not found" in done.stderr
    assert "--data-dir" in done.stderr and "nats://user:pw@host:port" in done.stderr
    assert not (tmp_path / "empty" / "nats" / "credentials.json").exists()  # it creates none


def test_credentials_in_the_url_are_saved_apart_from_it_and_privately(tmp_path: Path):
    done = nats_context(tmp_path, "--nats", "nats://alice:s%40cret@nats.example:4222,nats://nats2.example:4222",
                        "--name", "prod")
    assert done.returncode == 0, done.stderr
    saved = json.loads(context_file(tmp_path, "prod").read_text())
    assert saved["url"] == "nats://nats.example:4222,nats://nats2.example:4222"
    assert (saved["user"], saved["password"]) == ("alice", "s@cret")
    assert os.stat(context_file(tmp_path, "prod")).st_mode & 0o777 == 0o600
    assert os.stat(context_file(tmp_path, "prod").parent).st_mode & 0o777 == 0o700
    assert "next: nats --context prod stream ls" in done.stdout


def test_select_keeps_the_context_selected_before(tmp_path: Path):
    for name in ("first", "second"):
        done = nats_context(tmp_path, "--nats", "nats://u:p@127.0.0.1:4222", "--name", name, "--select")
        assert done.returncode == 0, done.stderr
    nats_dir = tmp_path / "config" / "nats"
    assert (nats_dir / "context.txt").read_text() == "second"
    assert (nats_dir / "previous-context.txt").read_text() == "first"  # `nats context select -` goes back


def test_a_name_that_is_not_a_file_name_is_refused(tmp_path: Path):
    done = nats_context(tmp_path, "--nats", "nats://u:p@127.0.0.1:4222", "--name", "../elsewhere")
    assert done.returncode == 2 and "invalid context name '../elsewhere'" in done.stderr
    assert not (tmp_path / "config" / "nats" / "elsewhere.json").exists()
