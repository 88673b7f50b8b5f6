"""Start `exo` as a separate process, the way a user does, and stop it with Ctrl-C (SIGINT)."""

from __future__ import annotations

import contextlib
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from exo.bus.server.embedded import load_credentials, with_user
from exo.bus.server.permissions import EXO_USER, OPERATOR_USER


def free_port() -> int:
    """A port that binds now, below the kernel's ephemeral range (see free_port_range)."""
    return free_port_range(1)


_handed_out: set[int] = set()  # this test process never hands a port out twice


def free_port_range(count: int) -> int:
    """The first of `count` consecutive ports that bind now, below the kernel's ephemeral range:
    a port inside it (what binding port 0 gives) can be taken by any outgoing connection's local
    port before its server binds it ("address already in use", "[ring] Couldn't bind socket
    (error: 98)"), and processes that retry connections make many of those."""
    try:
        ephemeral_start = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_start = 32768
    for _ in range(200):
        first = random.randrange(10000, ephemeral_start - count)
        ports = range(first, first + count)
        if _handed_out.isdisjoint(ports) and all(_binds(port) for port in ports):
            _handed_out.update(ports)
            return first
    raise RuntimeError(f"no {count} free consecutive ports below {ephemeral_start}")


def _binds(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def exo_command() -> list[str]:
    script = Path(sys.executable).parent / "exo"
    return [str(script)] if script.exists() else [sys.executable, "-m", "exo.main"]


class ExoProcess:
    def __init__(self, data_dir: Path, env: dict[str, str], extra_args: list[str] | None = None) -> None:
        self.data_dir = data_dir
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = [*exo_command(), "--data-dir", str(data_dir), "--nats-port", "0",
                     "--host", "127.0.0.1", "--api-port", str(self.port), *(extra_args or [])]
        self.env = {**os.environ, **env}
        self.log_path = data_dir.parent / f"{data_dir.name}-exo.log"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 90.0) -> ExoProcess:
        return self.launch().wait_ready(timeout)

    def launch(self) -> ExoProcess:
        """Start the process without waiting for it (see start_all)."""
        self.log = open(self.log_path, "wb")
        self.process = subprocess.Popen(self.args, stdout=self.log, stderr=subprocess.STDOUT, env=self.env)
        return self

    def wait_ready(self, timeout: float = 90.0) -> ExoProcess:
        assert self.process is not None, "launch it first"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"exo exited with {self.process.returncode}:\n{self.output()}")
            if "node ready" in self.output():
                return self
            time.sleep(0.02)  # a small file read: every start in the suite waits ~50 ms less than at 0.1 s
        raise RuntimeError(f"exo did not become ready in {timeout} s:\n{self.output()}")

    def nats_url(self, user: str = EXO_USER) -> str:
        """The node's embedded NATS server (as printed), with the password of `user` from its data dir."""
        printed = re.search(r"NATS at (\S+)", self.output())
        assert printed is not None, "no 'NATS at' line in the node's log"
        address = printed.group(1)
        credentials = load_credentials(self.data_dir / "nats")
        password = credentials.operator_password if user == OPERATOR_USER else credentials.exo_password
        return with_user(address, user, password)

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def interrupt(self, timeout: float = 30.0) -> int:
        """Ctrl-C once and wait for a clean exit."""
        assert self.process is not None
        self.process.send_signal(signal.SIGINT)
        return self.wait_exit(timeout)

    def wait_exit(self, timeout: float = 30.0) -> int:
        """Its exit status, killed if it has not exited within `timeout`."""
        assert self.process is not None
        try:
            return self.process.wait(timeout)
        finally:
            if self.process.poll() is None:
                self.process.kill()
            self.log.close()


def start_all(processes: Sequence[ExoProcess], timeout: float = 150.0) -> list[ExoProcess]:
    """Start every process at once and wait until each is ready: nodes that do not depend on each
    other's start need not wait for it one after another (a start is seconds of imports and handshakes)."""
    for process in processes:
        process.launch()
    deadline = time.monotonic() + timeout
    try:
        return [process.wait_ready(max(1.0, deadline - time.monotonic())) for process in processes]
    except BaseException:  # none is left running for a caller that never got them
        with contextlib.suppress(subprocess.TimeoutExpired):  # (a late one is killed)
            interrupt_all(processes, timeout=10)
        raise


def interrupt_all(processes: Sequence[ExoProcess], timeout: float = 30.0) -> list[int]:
    """Ctrl-C every running process at once, then wait for each (killed past `timeout`)."""
    running = [p for p in processes if p.process is not None and p.process.poll() is None]
    for process in running:
        assert process.process is not None
        process.process.send_signal(signal.SIGINT)
    deadline = time.monotonic() + timeout
    codes: list[int] = []
    late: subprocess.TimeoutExpired | None = None
    for process in running:  # every one waited for (and killed if late) before a late one is reported
        try:
            codes.append(process.wait_exit(max(1.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired as error:
            late = late or error
    if late is not None:
        raise late
    return codes


def runner_pids(parent: int) -> list[int]:
    """The runners a node's exo process (`parent`) started: its children running `-m exo.runner`."""
    found = []
    for pid in map(int, filter(str.isdigit, os.listdir("/proc"))):
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            ppid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if ppid == parent and b"exo.runner" in command:
            found.append(pid)
    return found
