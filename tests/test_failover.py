"""A master that survives: kill -9 and SIGSTOP of the leader with commands in flight, and a
full restart of everything, nothing lost, nothing applied twice, State equal to a replay."""

from __future__ import annotations

import collections
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from exo.core.events import CustomCardAdded, LeaderElected
from tests.support.cluster import NatsServer, quick_takeover_streams, replay, start_node, state_of, wait_until
from tests.support.exo_process import ExoProcess
from tests.support.tiny_model import make_tiny_model

pytestmark = pytest.mark.slow

# The lease's TTL in these tests: streams/KV_exo-leader.json's 10 s halved through EXO_STREAMS_DIR
# (the master renews every TTL/5 and holds the lease for 0.6 TTL after a renewal, whatever the TTL),
# and the master consumer's ack wait with it (the command the dead master had taken comes back
# after it): a takeover and the commands behind it wait ~5 s less.
LEASE_TTL_S = 5


@pytest.fixture
def nats(tmp_path: Path):
    server = NatsServer(tmp_path / "nats")
    yield server
    server.stop()


@pytest.fixture
def lease(tmp_path: Path) -> dict[str, str]:
    """The env of a node whose lease TTL and master consumer's ack wait are LEASE_TTL_S."""
    return quick_takeover_streams(tmp_path / "streams", LEASE_TTL_S)


def node_id(node: ExoProcess) -> str:
    return httpx.get(f"{node.url}/node_id").json()


class CardSender:
    """Adds custom cards one after another through a node's API, timing each answer."""

    def __init__(self, api_url: str, prefix: str) -> None:
        self.http = httpx.Client(base_url=api_url, timeout=60)
        self.prefix = prefix
        self.results: list[tuple[str, int, float]] = []  # (model id, status, seconds)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        n = 0
        while not self._stop.is_set():
            model_id = f"{self.prefix}/m{n}"
            started = time.monotonic()
            response = self.http.post("/models/add", json={"model_id": model_id, "n_layers": 2})
            self.results.append((model_id, response.status_code, time.monotonic() - started))
            n += 1

    def __enter__(self) -> CardSender:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(90)
        self.http.close()


def assert_each_command_applied_once(nats_url: str, upto: int, cards: list[str]) -> None:
    state, seen = replay(nats_url, upto)
    applied = collections.Counter(e.card.model_id for _, e, ok in seen if ok and isinstance(e, CustomCardAdded))
    assert {c: applied[c] for c in cards} == {c: 1 for c in cards}
    return state


def test_kill_9_the_master_under_load_and_the_other_takes_over(tmp_path, nats, lease):
    first = start_node(tmp_path, "first", nats.url, "--no-worker", env=lease)
    wait_until(lambda: state_of(first).leader_node == node_id(first), 20, what="first node leads")
    second = start_node(tmp_path, "second", nats.url, "--no-worker", env=lease)
    try:
        with CardSender(second.url, "load") as sender:
            wait_until(lambda: len(sender.results) >= 10, 30, what="commands flowing")
            first.process.kill()  # kill -9
            killed_at = time.monotonic()
            wait_until(lambda: state_of(second).leader_node == node_id(second), LEASE_TTL_S + 10, what="takeover")
            takeover_s = time.monotonic() - killed_at
            count = len(sender.results)
            wait_until(lambda: len(sender.results) >= count + 10, 30, what="commands flowing again")
        assert takeover_s < LEASE_TTL_S + 5
        assert all(status == 200 for _, status, _ in sender.results), sender.results
        final = state_of(second)
        cards = [model_id for model_id, _, _ in sender.results]
        assert sorted(final.custom_model_cards) == sorted(cards)
        assert assert_each_command_applied_once(nats.url, final.last_seq, cards) == final
    finally:
        second.interrupt()


def test_a_stale_master_resumed_after_its_lease_cannot_change_state(tmp_path, nats, lease):
    stale = start_node(tmp_path, "stale", nats.url, "--no-worker", env=lease)
    wait_until(lambda: state_of(stale).leader_node == node_id(stale), 20, what="first node leads")
    stale_term = state_of(stale).leader_term
    other = start_node(tmp_path, "other", nats.url, "--no-worker", env=lease)
    try:
        with CardSender(other.url, "paused") as sender:
            wait_until(lambda: len(sender.results) >= 5, 30, what="commands flowing")
            stale.process.send_signal(signal.SIGSTOP)
            wait_until(lambda: state_of(other).leader_node == node_id(other), LEASE_TTL_S + 10, what="takeover")
            time.sleep(2)
            stale.process.send_signal(signal.SIGCONT)
            count = len(sender.results)
            wait_until(lambda: len(sender.results) >= count + 10, 30, what="commands flowing after the resume")
        wait_until(lambda: "no longer leading" in stale.output(), 10, what="the stale master stands down")
        assert all(status == 200 for _, status, _ in sender.results), sender.results
        final = state_of(other)
        assert final.leader_node == node_id(other) and final.leader_term > stale_term
        state, seen = replay(nats.url, final.last_seq)
        elected = next(seq for seq, e, _ in seen if isinstance(e, LeaderElected) and seq == final.leader_term)
        late_from_stale = [(seq, e, ok) for seq, e, ok in seen if seq > elected and e.term == stale_term]
        assert not any(ok for _, _, ok in late_from_stale)  # whatever it wrote afterwards was ignored
        assert state == final == state_of(stale)
        assert_each_command_applied_once(nats.url, final.last_seq, [m for m, _, _ in sender.results])
    finally:
        for node in (other, stale):
            if node.process.poll() is None:
                node.interrupt()


def test_a_full_restart_brings_placed_instances_and_custom_cards_back(tmp_path):
    model_dir = make_tiny_model(tmp_path / "model")
    data_dir = tmp_path / "node"
    messages = [{"role": "user", "content": "Hello again"}]
    body = {"model": "local/tiny", "messages": messages, "temperature": 0, "max_tokens": 10}

    node = ExoProcess(data_dir, {}).start()
    with httpx.Client(base_url=node.url, timeout=120) as http:
        assert http.post("/models/add", json={"model_id": "local/tiny", "path": str(model_dir)}).status_code == 200
        instance = http.post("/place_instance", json={"model_id": "local/tiny"}).json()["instance_id"]
        before = http.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["content"]
    assert node.interrupt() == 0  # the embedded nats-server stops with it

    node = ExoProcess(data_dir, {}).start()
    try:
        with httpx.Client(base_url=node.url, timeout=120) as http:
            assert "local/tiny" in [m["id"] for m in http.get("/v1/models").json()["data"]]
            after = http.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["content"]
            state = state_of(node)
        assert after == before
        assert list(state.instances) == [instance]
        assert [r.status for r in state.runners.values()] == ["ready"]
        assert (data_dir / "custom_cards" / "local--tiny.toml").exists()
    finally:
        node.interrupt()
