"""What `exo` says at start, with real processes: the banner (where to go, what to run next, one line
per real risk with its fix), a second node on one machine (each error names its flag; taken default
ports are replaced and said), the node's name, and one address setting for discovery and rings."""

from __future__ import annotations

import os
import platform
import re
import socket
import subprocess
import uuid
from pathlib import Path

import httpx
import pytest

from exo.bus.errors import BusError
from exo.bus.server.cluster_secret import lan_address
from exo.bus.server.embedded import EmbeddedNats
from exo.defaults import DEFAULT_API_PORT, DEFAULT_NATS_PORT
from tests.support.exo_process import ExoProcess, exo_command, interrupt_all, start_all

pytestmark = pytest.mark.slow


def run_exo(args: list[str], env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([*exo_command(), *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def banner_of(exo: ExoProcess) -> list[str]:
    """The lines exo printed from "node ready" on, without log lines."""
    lines = exo.output().splitlines()
    start = next(i for i, line in enumerate(lines) if "node ready" in line)
    return [line for line in lines[start:] if line.startswith(("exo:", "  "))]


def own_node(exo: ExoProcess) -> dict:
    node_id = httpx.get(f"{exo.url}/node_id").json()
    return httpx.get(f"{exo.url}/state").json()["nodes"][node_id]


def without_host_flag(exo: ExoProcess) -> ExoProcess:
    """As a user starts it: no --host, so the default applies."""
    at = exo.args.index("--host")
    del exo.args[at:at + 2]
    return exo


def test_a_loopback_node_prints_where_to_go_and_what_to_run_and_no_risk(tmp_path: Path):
    """Discovery on 127.0.0.1 with no secret and no --host: the API follows the address onto loopback,
    the ring address is 127.0.0.1 (not the LAN's), and nothing is open to the network: no risk lines."""
    env = {"EXO_DISCOVERY": "1", "EXO_DISCOVERY_ADDRESS": "127.0.0.1", "EXO_NAMESPACE": f"t-{uuid.uuid4().hex[:8]}",
           "EXO_NODE_NAME": "studio-1"}
    exo = without_host_flag(ExoProcess(tmp_path / "data", env)).start()
    try:
        port = exo.port
        banner = banner_of(exo)
        assert banner[0].startswith(f"exo: node ready, API at http://127.0.0.1:{port}, NATS at nats://127.0.0.1:")
        assert f"  node 'studio-1'; dashboard: http://127.0.0.1:{port}/" in banner
        place = f"""curl -X POST 127.0.0.1:{port}/place_instance -d '{{"model_id": "mlx-community/Qwen3-0.6B-4bit\""""
        assert any(line.strip().startswith(place) for line in banner), banner
        assert any(f"127.0.0.1:{port}/v1/chat/completions" in line for line in banner)
        assert any(f"127.0.0.1:{port}/models/add" in line for line in banner)
        assert not [line for line in banner if line.startswith("  risk:")], banner
        assert len(banner) <= 8
        node = own_node(exo)
        assert (node["name"], node["addresses"]) == ("studio-1", ["127.0.0.1"])
        with socket.create_connection(("127.0.0.1", port)):
            pass
        lan = lan_address()
        if lan != "127.0.0.1":  # the API is not on the LAN address
            with pytest.raises(OSError), socket.create_connection((lan, port), timeout=2):
                pass
    finally:
        assert exo.interrupt() == 0


def test_an_open_api_is_one_risk_line_with_its_fix_and_advertise_addresses_still_win(tmp_path: Path):
    env = {"EXO_DISCOVERY_ADDRESS": "127.0.0.1", "EXO_ADVERTISE_ADDRESSES": "10.1.2.3"}
    exo, keyed = start_all([ExoProcess(tmp_path / "data", env, ["--host", "0.0.0.0"]),
                            ExoProcess(tmp_path / "keyed", {"EXO_API_KEYS": "k1"}, ["--host", "0.0.0.0"])])
    try:
        risks = [line for line in banner_of(exo) if line.startswith("  risk:")]
        assert risks == [f"  risk: the API listens on 0.0.0.0:{exo.port} without API keys: anyone who can reach "
                         f"this machine can use it; fix: --host 127.0.0.1 (this machine only) or EXO_API_KEYS=<key> "
                         f"(or --api-key)"]
        node = own_node(exo)
        assert node["addresses"] == ["10.1.2.3"]
        assert node["name"] == f"{platform.node()}:{exo.port}"  # not the default port: told apart by it
        # with a key it is not a risk, and the commands shown send one
        banner = banner_of(keyed)
        assert not [line for line in banner if line.startswith("  risk:")], banner
        assert any(line.strip().startswith("curl -H 'Authorization: Bearer <key>' -X POST") for line in banner), banner
    finally:
        assert interrupt_all([exo, keyed]) == [0, 0]


def test_trusted_lan_is_one_risk_line_that_is_the_same_at_every_start(tmp_path: Path):
    lan = lan_address()
    if lan == "127.0.0.1":
        pytest.skip("this machine has no LAN address")
    env = {"EXO_DISCOVERY": "1", "EXO_DISCOVERY_ADDRESS": lan, "EXO_NAMESPACE": f"t-{uuid.uuid4().hex[:8]}"}
    lines = []
    for _ in range(2):
        exo = ExoProcess(tmp_path / "data", env).start()
        try:
            lines.append([line for line in banner_of(exo) if line.startswith("  risk:")])
        finally:
            assert exo.interrupt() == 0
    secret_file = tmp_path / "data" / "nats" / "cluster-secret"
    assert lines[0] == lines[1] == [
        f"  risk: trusted-LAN mode: any exo of namespace '{env['EXO_NAMESPACE']}' on the LAN can join this node's "
        f"NATS cluster and read or write its log; fix: start every node once with the same "
        f"EXO_CLUSTER_SECRET=<long random string, e.g. from `openssl rand -hex 24`> (kept in {secret_file})"]
    assert not re.search(r"[0-9a-f]{32}", lines[0][0])  # no invented secret to copy
    assert exo.output().count("EXO_CLUSTER_SECRET") == 1  # said once, in the banner: no warning besides


def test_a_second_node_on_one_machine_is_told_each_fix_and_default_ports_move_aside(tmp_path: Path):
    first = ExoProcess(tmp_path / "first", {}).start()
    held = []
    try:
        same_dir = run_exo(["--data-dir", str(first.data_dir), "--api-port", "0", "--nats-port", "0"])
        assert same_dir.returncode == 1
        assert same_dir.stderr.strip().splitlines()[-1] == (
            f"exo: another exo process is using the data dir {first.data_dir}; a second node on this machine "
            f"needs a data dir of its own: --data-dir {first.data_dir}-2 (or EXO_HOME)")
        nats_port = int(re.search(r"NATS at nats://127\.0\.0\.1:(\d+)", first.output()).group(1))
        taken_nats = run_exo(["--data-dir", str(tmp_path / "second"), "--host", "127.0.0.1", "--api-port", "0",
                              "--nats-port", str(nats_port)])
        assert taken_nats.returncode == 1
        assert taken_nats.stderr.strip().splitlines()[-1] == (
            f"exo: cannot listen on 127.0.0.1:{nats_port}: Address already in use (another exo on this machine?); "
            f"pass --nats-port 0 (any free port) or another --nats-port")
        # The defaults taken (by us, if nothing else has them): a node started without ports moves aside.
        held = [_hold(DEFAULT_API_PORT), _hold(DEFAULT_NATS_PORT)]
        second = ExoProcess(tmp_path / "second", {})
        second.args = [*exo_command(), "--data-dir", str(second.data_dir), "--host", "127.0.0.1"]
        second.start()
        try:
            note = next(line for line in banner_of(second) if "default ports taken" in line)
            api, nats = (int(port) for port in re.search(r"API 52415 -> (\d+), NATS 4222 -> (\d+)", note).groups())
            assert f"API at http://127.0.0.1:{api}, NATS at nats://127.0.0.1:{nats}" in second.output()
            second.url = f"http://127.0.0.1:{api}"
            assert own_node(second)["name"] == f"{platform.node()}:{api}"
        finally:
            assert second.interrupt() == 0
    finally:
        for sock in held:
            if sock is not None:
                sock.close()
        assert first.interrupt() == 0


def _hold(port: int) -> socket.socket | None:
    """Listen on 127.0.0.1:port if nothing does yet (None: something else already holds it)."""
    sock = socket.socket()
    try:
        sock.bind(("127.0.0.1", port))
    except OSError:
        sock.close()
        return None
    sock.listen()
    return sock


async def test_an_embedded_server_that_cannot_listen_says_where_and_the_flag(tmp_path: Path):
    """Past the check at start (a port taken in between, or the cluster port): the server's own error."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        server = EmbeddedNats(tmp_path / "nats", port=port)
        with pytest.raises(BusError) as raised:
            await server.start()
    assert str(raised.value) == (f"the embedded nats-server cannot listen on 127.0.0.1:{port}: address already in use "
                                 f"(another exo on this machine?); pass --nats-port 0 (any free port) or another "
                                 f"--nats-port")
