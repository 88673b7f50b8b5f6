"""Self-healing (issue #29) on a real cluster: three `exo` nodes on one machine, each with its own
embedded nats-server, found by discovery on 127.0.0.1 (one JetStream cluster, streams at three
replicas). A node "dies" with kill -9 of everything it runs (exo, its runners, its nats-server)
or pauses with SIGSTOP of all of them. Shared by tests/test_self_healing.py and
bench/self_healing.py."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import httpx

from exo.bus.server.membership import load_membership
from exo.core.ids import InstanceId
from exo.core.state import State, decode_state
from tests.support import polling
from tests.support.exo_process import ExoProcess, free_port_range, interrupt_all

MODEL = "local/tiny4"
SUSPECT_S = 3.0  # EXO_SUSPECT_S: pulses (every second) silent this long and a node's instances are lost
RING_JOIN_S = "15"  # EXO_RING_JOIN_TIMEOUT_S: a ring group that has not formed by then is formed again
# --node-timeout: silent this long and the node leaves State (a paused master: takeover + suspect fit under it)
NODE_TIMEOUT_S = 20.0
T = TypeVar("T")


def ring_ports() -> str:
    first = free_port_range(21)
    return f"{first}-{first + 20}"


def node_env(namespace: str, extra: dict[str, str] | None = None) -> dict[str, str]:
    return {"EXO_DISCOVERY": "1", "EXO_DISCOVERY_ADDRESS": "127.0.0.1", "EXO_NAMESPACE": namespace,
            "EXO_SUSPECT_S": f"{SUSPECT_S:g}", "EXO_RING_PORTS": ring_ports(), "EXO_RING_JOIN_TIMEOUT_S": RING_JOIN_S,
            **(extra or {})}


def node_id_of(node: ExoProcess) -> str:
    return (node.data_dir / "node_id").read_text().strip()


def pids_of(node: ExoProcess) -> set[int]:
    """Every process of the node: exo, its children (runners) and its nats-servers (their own
    sessions, found by the data dir on their command line)."""
    alive = node.process is not None and node.process.poll() is None  # else its pid may be someone else's
    pids = {node.process.pid} if node.process is not None and alive else set()
    for pid in map(int, filter(str.isdigit, os.listdir("/proc"))):
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes()
            parent = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if f"{node.data_dir}/".encode() in command or (alive and parent in pids):
            pids.add(pid)
    return pids


def signal_all(pids: set[int], signum: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass


def kill_9(node: ExoProcess) -> None:
    """The machine is gone: all of its processes at once, nothing of it left."""
    pids = pids_of(node)
    # Frozen first, then killed: killed one by one, a worker could see its runner die (exit -9) and
    # report that failure to the client before its own SIGKILL, which a lost machine never does.
    signal_all(pids, signal.SIGSTOP)
    signal_all(pids, signal.SIGKILL)
    if node.process is not None:
        node.process.wait()
    if hasattr(node, "log") and not node.log.closed:
        node.log.close()


def start_together(nodes: list[ExoProcess], timeout: float = 150.0) -> None:
    """Start every node at once (machines switched on together) and wait until each is ready."""
    for node in nodes:
        node.log = open(node.log_path, "ab")
        node.process = subprocess.Popen(node.args, stdout=node.log, stderr=subprocess.STDOUT, env=node.env)
    deadline = time.monotonic() + timeout
    for node in nodes:
        while "node ready" not in node.output():
            assert node.process is not None and node.process.poll() is None, node.output()[-5000:]
            assert time.monotonic() < deadline, f"{node.data_dir.name} not ready:\n{node.output()[-5000:]}"
            time.sleep(0.1)


def restart(node: ExoProcess, timeout: float = 150.0) -> None:
    """A killed machine back: the same data dir and ports (it rejoins the cluster it kept)."""
    node.log = open(node.log_path, "ab")
    start_from = node.log_path.stat().st_size
    node.process = subprocess.Popen(node.args, stdout=node.log, stderr=subprocess.STDOUT, env=node.env)
    deadline = time.monotonic() + timeout
    while "node ready" not in node.log_path.read_text(errors="replace")[start_from:]:
        assert node.process.poll() is None, node.output()[-5000:]
        assert time.monotonic() < deadline, f"{node.data_dir.name} not ready again:\n{node.output()[-5000:]}"
        time.sleep(0.1)


def stop_all(nodes: list[ExoProcess]) -> None:
    """Ctrl-C every live node at once; whatever outlives that is killed."""
    for node in nodes:
        if node.process is not None and node.process.poll() is None:
            signal_all(pids_of(node), signal.SIGCONT)  # a paused node cannot stop
    try:
        interrupt_all(nodes, timeout=20)
    except Exception:  # noqa: BLE001 (killed below)
        pass
    for node in nodes:
        if node.process is not None:
            kill_9(node)


def wait_until(predicate: Callable[[], T | None], timeout: float, interval: float = 0.1, what: str = "condition") -> T:
    """polling.wait_until, where a failed request is "not yet": a node between leaders, or the one being killed."""
    return polling.wait_until(predicate, timeout, interval, what, tolerate=(httpx.HTTPError, OSError))


def state_of(node: ExoProcess) -> State:
    return decode_state(httpx.get(f"{node.url}/state", timeout=30).content)


def metric(node: ExoProcess, name: str) -> float:
    text = httpx.get(f"{node.url}/metrics", timeout=30).text
    found = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


@dataclass
class Chunk:
    at: float  # time.monotonic() it arrived
    text: str
    finish_reason: str | None
    raw: dict[str, Any]  # the whole chunk as sent


@dataclass
class Streamed:
    """A streamed chat completion read in a thread, chunk by chunk, with when each came."""

    chunks: list[Chunk] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    status: int = 0
    done: threading.Event = field(default_factory=threading.Event)
    task_id: str = ""

    @property
    def text(self) -> str:
        return "".join(c.text for c in self.chunks)

    @property
    def finish_reason(self) -> str | None:
        return next((c.finish_reason for c in reversed(self.chunks) if c.finish_reason), None)

    def text_chunks(self) -> int:
        return sum(1 for c in self.chunks if c.text)

    def first_text_after(self, moment: float) -> float | None:
        return next((c.at for c in self.chunks if c.text and c.at > moment), None)

    def longest_pause(self) -> float:
        times = [c.at for c in self.chunks if c.text]
        return max((b - a for a, b in zip(times, times[1:])), default=0.0)


def stream_chat(api_url: str, body: dict[str, Any], timeout: float = 240.0) -> Streamed:
    """Start a streamed chat on `api_url` in a thread; returns at once."""
    result = Streamed()

    def read() -> None:
        try:
            with httpx.stream("POST", f"{api_url}/v1/chat/completions", json={**body, "stream": True},
                              timeout=timeout) as response:
                result.status = response.status_code
                if response.status_code != 200:
                    result.errors.append(response.read().decode(errors="replace"))
                    return
                for line in response.iter_lines():
                    if not line.startswith("data: {"):
                        continue
                    data = json.loads(line[6:])
                    if "error" in data:
                        result.errors.append(json.dumps(data["error"]))
                        continue
                    result.task_id = result.task_id or data["id"].removeprefix("chatcmpl-")
                    for choice in data.get("choices") or []:
                        result.chunks.append(Chunk(time.monotonic(), choice["delta"].get("content") or "",
                                                   choice.get("finish_reason"), data))
        except Exception as error:  # noqa: BLE001 (the test reads it)
            result.errors.append(repr(error))
        finally:
            result.done.set()

    threading.Thread(target=read, daemon=True).start()
    return result


def chat_body(messages: list[dict[str, Any]], max_tokens: int, **sampling: object) -> dict[str, Any]:
    return {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0, **sampling}


class Cluster:
    """Three discovered nodes (exo + nats-server each) serving MODEL from `model_dir`."""

    def __init__(self, root: Path, model_dir: Path, count: int = 3, env: dict[str, str] | None = None) -> None:
        self.namespace = f"heal-{uuid.uuid4().hex[:8]}"
        self.model_dir = model_dir
        self.nodes = [ExoProcess(root / f"node-{n}", node_env(self.namespace, env),
                                 ["--node-timeout", f"{NODE_TIMEOUT_S:g}"]) for n in range(count)]

    def start(self) -> Cluster:
        start_together(self.nodes)
        wait_until(lambda: len(state_of(self.nodes[0]).nodes) == len(self.nodes), 60, 0.5, "every node in State")
        # until the witness retires, the seed's machine holds two of the four meta votes: killing it
        # then would stop the event log, which is not what these tests are about
        wait_until(lambda: any((m := load_membership(n.data_dir / "nats")) is not None and m.witness_retired
                               for n in self.nodes), 60, 0.5, "the seed's witness retired")
        added = httpx.post(f"{self.nodes[0].url}/models/add", json={"model_id": MODEL, "path": str(self.model_dir)},
                           timeout=60)
        assert added.status_code == 200, added.text
        return self

    def stop(self) -> None:
        stop_all(self.nodes)

    def alive(self) -> list[ExoProcess]:
        return [n for n in self.nodes if n.process is not None and n.process.poll() is None]

    def by_id(self, node_id: str) -> ExoProcess:
        return next(n for n in self.nodes if node_id_of(n) == node_id)

    def state(self, via: ExoProcess | None = None) -> State:
        return state_of(via or self.alive()[0])

    def hosts(self, instance_id: InstanceId, via: ExoProcess | None = None) -> list[ExoProcess]:
        instance = self.state(via).instances[instance_id]
        return [self.by_id(s.node_id) for s in sorted(instance.shards, key=lambda s: s.rank)]

    def place(self, via: ExoProcess, **extra: object) -> dict[str, Any]:
        body = {"model_id": MODEL, "wait": 120, **extra}
        placed = httpx.post(f"{via.url}/place_instance", json=body, timeout=150)
        assert placed.status_code == 200, placed.text
        answer: dict[str, Any] = placed.json()
        return answer

    def ready(self, instance_id: InstanceId, via: ExoProcess) -> bool:
        state = state_of(via)
        instance = state.instances.get(instance_id)
        return instance is not None and all(
            (r := state.runners.get(s.runner_id)) is not None and r.status == "ready" for s in instance.shards)

    def clear(self, via: ExoProcess) -> None:
        """No desire and no instance left (each desire ends with its last instance)."""
        for desire_id in list(state_of(via).desires):  # its instances go with it
            httpx.delete(f"{via.url}/desire/{desire_id}", timeout=60)
        for instance_id in list(state_of(via).instances):
            httpx.delete(f"{via.url}/instance/{instance_id}", timeout=60)
        wait_until(lambda: not (s := state_of(via)).instances and not s.runners and not s.desires, 60, 0.3,
                   "no instance, runner or desire left")

    def bring_back(self) -> None:
        """Every killed node started again, and in State."""
        for node in self.nodes:
            if node.process is None or node.process.poll() is not None:
                restart(node)
        wait_until(lambda: len((s := state_of(self.nodes[0])).nodes) == len(self.nodes)
                   and sum(server.online for server in s.cluster.servers) == len(self.nodes), 60, 0.5,
                   "every node and its nats-server back in State")


class SharedNatsCluster(Cluster):
    """A head (master and API, never killed) and three worker nodes on one nats-server of the
    test's own: a node "dies" with its exo and runners (kill -9), which it can do as often as a
    test wants; it is back in seconds. The cluster above kills nats-servers too, which a
    discovered cluster survives once before it must rejoin."""

    def __init__(self, root: Path, model_dir: Path, count: int = 3, env: dict[str, str] | None = None) -> None:
        from tests.support.cluster import NatsServer

        self.model_dir = model_dir
        self.nats = NatsServer(root / "nats")
        base = {"EXO_NATS_URL": self.nats.url, "EXO_SUSPECT_S": f"{SUSPECT_S:g}", "EXO_RING_JOIN_TIMEOUT_S": RING_JOIN_S,
                "EXO_ADVERTISE_ADDRESSES": "127.0.0.1", **(env or {})}
        flags = ["--node-timeout", f"{NODE_TIMEOUT_S:g}"]
        self.head = ExoProcess(root / "head", base, [*flags, "--no-worker"])
        self.nodes = [ExoProcess(root / f"node-{n}", {**base, "EXO_RING_PORTS": ring_ports()}, [*flags, "--no-master"])
                      for n in range(count)]

    def start(self) -> SharedNatsCluster:
        start_together([self.head, *self.nodes])
        wait_until(lambda: len(state_of(self.head).nodes) == len(self.nodes), 60, 0.3, "every node in State")
        added = httpx.post(f"{self.head.url}/models/add", json={"model_id": MODEL, "path": str(self.model_dir)},
                           timeout=60)
        assert added.status_code == 200, added.text
        return self

    def stop(self) -> None:
        stop_all([*self.nodes, self.head])
        self.nats.stop()

    def bring_back(self) -> None:
        for node in self.nodes:
            if node.process is None or node.process.poll() is not None:
                restart(node)
        wait_until(lambda: len(state_of(self.head).nodes) == len(self.nodes), 60, 0.3, "every node back in State")

    def alive(self) -> list[ExoProcess]:
        return [self.head, *super().alive()]
