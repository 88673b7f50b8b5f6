"""A request while the event log has lost its quorum (an R3 cluster with two of its three servers
gone: NATS still connected, nothing can be appended) is a 503 with Retry-After naming the cause
within seconds on every surface, never a 504 after the 30 s wait for the master's answer, and
nothing is queued that could run later for nobody; once the servers are back, chats work again.
The three nats-servers are the test's own, clustered as exo's discovered ones are; one exo node
(master, worker, API) uses the first, which survives."""

from __future__ import annotations

import asyncio
import shutil
import time
from pathlib import Path

import httpx
import pytest

from exo.bus.readiness import looks_quorumless
from exo.bus.server.cluster_node import free_port
from exo.bus.server.embedded import CREDENTIALS_FILE, EmbeddedNats, load_credentials
from exo.bus.server.server_config import ClusterLink, route_url
from tests.support.cluster import state_of, wait_until
from tests.support.exo_process import ExoProcess
from tests.support.tiny_model import make_tiny_model

MODEL = "local/tiny"
MESSAGES = [{"role": "user", "content": "Hello"}]
CAUSE = "no quorum for EXO_EVENTS: "


class ThreeServers:
    """Three nats-servers routed to each other as one JetStream cluster, sharing credentials."""

    def __init__(self, root: Path) -> None:
        ports = [free_port("127.0.0.1") for _ in range(3)]
        load_credentials(root / "s0")  # written into s0, copied to the others
        self.servers: list[EmbeddedNats] = []
        for n, port in enumerate(ports):
            store = root / f"s{n}"
            store.mkdir(parents=True, exist_ok=True)
            if n:
                shutil.copy(root / "s0" / CREDENTIALS_FILE, store / CREDENTIALS_FILE)
            link = ClusterLink(name="exo-quorum-test", host="127.0.0.1", port=port, secret="route-secret",
                               routes=[route_url("127.0.0.1", other) for other in ports if other != port])
            self.servers.append(EmbeddedNats(store, port=0, server_name=f"exo-server-{n}", cluster=link))
        self.start(self.servers)

    @staticmethod
    def start(servers: list[EmbeddedNats]) -> None:
        async def starting() -> None:
            await asyncio.gather(*(server.start() for server in servers))
        asyncio.run(starting())

    def stop(self) -> None:
        for server in self.servers:
            server.stop()


@pytest.fixture
def three_servers(tmp_path: Path):
    cluster = ThreeServers(tmp_path / "nats")
    yield cluster
    cluster.stop()


def _requests() -> dict[str, tuple[str, dict[str, object]]]:
    """One small request per surface, greedy, so each surface answers the same text each time."""
    return {
        "openai chat": ("/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "max_tokens": 5, "temperature": 0}),
        "openai completions": ("/v1/completions", {"model": MODEL, "prompt": "Hello", "max_tokens": 5, "temperature": 0}),
        "anthropic messages": ("/v1/messages", {"model": MODEL, "messages": MESSAGES, "max_tokens": 5, "temperature": 0}),
        "ollama chat": ("/api/chat", {"model": MODEL, "messages": MESSAGES, "stream": False,
                                      "options": {"num_predict": 5, "temperature": 0}}),
    }


def _error_message(surface: str, body: dict[str, object]) -> str:
    error = body["error"]
    return error if isinstance(error, str) else str(error["message"])  # type: ignore[index]


@pytest.mark.slow  # an exo node with a model, and nats-servers stopped and started under it
def test_a_chat_without_a_quorum_for_the_event_log_is_a_503_naming_it_within_seconds_and_works_once_it_is_back(
        tmp_path, three_servers):
    model_dir = make_tiny_model(tmp_path / "model")
    survivor, *others = three_servers.servers
    node = ExoProcess(tmp_path / "node", {"EXO_REPLICAS": "3"}, ["--nats", survivor.url]).start(timeout=150)
    try:
        with httpx.Client(base_url=node.url, timeout=120) as http:
            assert http.post("/models/add", json={"model_id": MODEL, "path": str(model_dir)}).status_code == 200
            assert http.post("/place_instance", json={"model_id": MODEL}).status_code in (200, 202)
            answered = {surface: http.post(path, json=body) for surface, (path, body) in _requests().items()}
            assert {s: a.status_code for s, a in answered.items()} == dict.fromkeys(answered, 200), \
                {s: a.text for s, a in answered.items()}
            tasks_before = len(state_of(node).tasks)

            for server in others:
                server.kill()
            wait_until(lambda: CAUSE in http.get("/health").json().get("problem", ""), 30, 0.2,
                       "/health names the lost quorum")
            for surface, (path, body) in _requests().items():
                started = time.monotonic()
                refused = http.post(path, json=body)
                took = time.monotonic() - started
                message = _error_message(surface, refused.json())
                assert (refused.status_code, refused.headers.get("Retry-After")) == (503, "5"), (surface, refused.text)
                assert message.startswith(f"the message bus (NATS) is unavailable: {CAUSE}"), (surface, message)
                assert message.endswith(" of 3 replicas current; retry in 5 s"), (surface, message)
                assert took < 5, f"{surface} was refused after {took:.1f} s"

            ThreeServers.start(others)
            wait_until(lambda: http.get("/health").status_code == 200, 90, 0.5, "/health ok again")
            again = {surface: http.post(path, json=body) for surface, (path, body) in _requests().items()}
            assert {s: a.status_code for s, a in again.items()} == dict.fromkeys(again, 200), \
                {s: a.text for s, a in again.items()}
            # The refused requests queued nothing: only the four answered after the servers came back ran.
            assert len(state_of(node).tasks) == tasks_before + len(again)
    finally:
        node.interrupt()


def test_a_stream_looks_quorumless_with_fewer_current_replicas_than_a_majority_leader_included():
    assert not looks_quorumless(3, "n1", [True, False])
    assert looks_quorumless(3, "n1", [False, False])  # a leader that has not noticed it is alone
    assert looks_quorumless(3, None, [True, False, False])  # no leader: its replicas are all listed
    assert not looks_quorumless(3, None, [True, True, False])  # an election among two of three
    assert not looks_quorumless(1, "standalone", [])
    assert looks_quorumless(5, "n1", [True, False, False, False])
