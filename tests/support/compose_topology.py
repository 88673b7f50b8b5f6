"""compose.yaml, started as local processes: the same commands, environment and nats-server
config, with service hosts mapped to 127.0.0.1, ports to free ones and volumes to folders."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

from exo.bus.server.embedded import nats_server_binary
from tests.support.exo_process import free_port

REPO = Path(__file__).resolve().parents[2]  # tests/support/ -> the repository


class Service:
    def __init__(self, name: str, args: list[str], env: dict[str, str], log: Path) -> None:
        self.name, self.args, self.env, self.log_path = name, args, env, log
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> Service:
        self.log = open(self.log_path, "ab")
        self.process = subprocess.Popen(self.args, stdout=self.log, stderr=subprocess.STDOUT, env=self.env)
        return self

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, sig: int = signal.SIGINT, timeout: float = 30) -> None:
        self.signal(sig)
        self.wait_stopped(timeout)

    def signal(self, sig: int) -> None:
        if self.process and self.process.poll() is None:
            self.process.send_signal(sig)

    def wait_stopped(self, timeout: float = 30) -> None:
        """Its exit, killed if it takes longer than `timeout`."""
        if self.process:
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


class LocalTopology:
    def __init__(self, root: Path, extra_env: dict[str, str]) -> None:
        self.compose = yaml.safe_load((REPO / "compose.yaml").read_text())
        self.root, self.extra_env = root, extra_env
        self.nats_names = [n for n in self.compose["services"] if n.startswith("nats-")]
        self.ports = {n: {"4222": free_port(), "8222": free_port(), "6222": free_port()} for n in self.nats_names}
        self.api_port = free_port()
        self.services: dict[str, Service] = {}

    def _map_hosts(self, text: str) -> str:
        """nats-2:6222 -> 127.0.0.1:<free port of nats-2's 6222>, 0.0.0.0:P -> 127.0.0.1:<own P>."""
        def host_port(match: re.Match[str]) -> str:
            return f"127.0.0.1:{self.ports[match.group(1)][match.group(2)]}"
        return re.sub(r"(nats-\d+):(\d+)", host_port, text)

    def _volumes(self, service: dict[str, Any], name: str) -> dict[str, str]:
        mapping = {}
        for volume in service.get("volumes", []):
            source, target = volume.split(":")[:2]
            host = REPO / source if source.startswith("./") else self.root / source
            if not source.startswith("./"):
                host.mkdir(parents=True, exist_ok=True)
            mapping[target] = str(host)
        return mapping

    def _translate(self, name: str, arg: str, volumes: dict[str, str]) -> str:
        arg = self._map_hosts(arg)
        if name in self.ports:
            arg = arg.replace("0.0.0.0:6222", f"127.0.0.1:{self.ports[name]['6222']}")
        return volumes.get(arg, arg)

    def nats_service(self, name: str) -> Service:
        spec = self.compose["services"][name]
        volumes = self._volumes(spec, name)
        args = [self._translate(name, a, volumes) for a in spec["command"]]
        for flag, port in (("--port", "4222"), ("--http_port", "8222")):
            args[args.index(flag) + 1] = str(self.ports[name][port])
        return Service(name, [nats_server_binary(), *args], dict(os.environ), self.root / f"{name}.log")

    def exo_service(self, name: str) -> Service:
        spec = self.compose["services"][name]
        volumes = self._volumes(spec, name)
        command = [self._translate(name, a, volumes).replace("0.0.0.0", "127.0.0.1") for a in spec["command"]]
        if "--api-port" in command:
            command[command.index("--api-port") + 1] = str(self.api_port)
        env = {k: self._translate(name, str(v), volumes) for k, v in spec.get("environment", {}).items()}
        exo = str(Path(sys.executable).parent / command[0])
        return Service(name, [exo, *command[1:]], {**os.environ, **env, **self.extra_env}, self.root / f"{name}.log")

    def nats_healthy(self, name: str) -> bool:
        healthcheck = self.compose["services"][name]["healthcheck"]["test"][-1]
        url = healthcheck.replace("localhost:8222", f"127.0.0.1:{self.ports[name]['8222']}")
        try:
            return httpx.get(url, timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def start(self) -> None:
        for name in self.nats_names:
            self.services[name] = self.nats_service(name).start()
        deadline = time.monotonic() + 60
        while not all(self.nats_healthy(n) for n in self.nats_names):
            assert time.monotonic() < deadline, "NATS cluster not healthy"
            time.sleep(0.2)
        # all at once, as compose starts them (each depends on the NATS servers only)
        started = [self.exo_service(name).start() for name in self.compose["services"] if name.startswith("exo-")]
        for service in started:
            self.services[service.name] = service
        for service in started:
            self.wait_ready(service)

    def wait_ready(self, service: Service, timeout: float = 90) -> None:
        deadline = time.monotonic() + timeout
        while "node ready" not in service.output():
            assert service.process is not None and service.process.poll() is None, f"{service.name} exited:\n{service.output()}"
            assert time.monotonic() < deadline, f"{service.name} not ready:\n{service.output()}"
            time.sleep(0.1)

    @property
    def nats_urls(self) -> list[str]:
        return [f"nats://127.0.0.1:{self.ports[n]['4222']}" for n in self.nats_names]

    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.api_port}"

    def stop(self) -> None:
        """The exo services at once, then the NATS servers at once (as `compose down` stops them)."""
        services = list(reversed(self.services.values()))
        exo = [s for s in services if s.name.startswith("exo-")]
        for group in (exo, [s for s in services if s not in exo]):
            for service in group:
                service.signal(signal.SIGINT)
            for service in group:
                service.wait_stopped()
