"""compose.yaml describes a working cluster, and that cluster survives losing the NATS server
that leads the event stream: chat resumes within 15 s and every acknowledged event is still
in the log exactly once."""

from __future__ import annotations

import asyncio
import collections
import threading
import time
from pathlib import Path

import httpx
import pytest

from exo.bus.connection import connect
from tests.support.ack_recorder import AckRecorder
from tests.support.compose_topology import LocalTopology
from tests.support.fake_hub import FakeHub
from tests.support.tiny_model import TINY_MODEL_ID, make_tiny_model

pytestmark = pytest.mark.slow

MESSAGES = [{"role": "user", "content": "Hello, cluster"}]


def stream_events(urls: list[str]) -> list[tuple[int, str]]:
    """(sequence, id) of every event in the log: its Nats-Msg-Id, or where a master appended it in an
    atomic batch (which cannot carry one), its batch id and place in the batch."""

    async def run():
        nc = await connect(urls, name="test-reader")
        js = nc.jetstream()
        info = await js.stream_info("EXO_EVENTS")
        rows = []
        for seq in range(info.state.first_seq, info.state.last_seq + 1):
            msg = await js.get_msg("EXO_EVENTS", seq)
            headers = msg.headers or {}
            rows.append((seq, headers.get("Nats-Msg-Id") or f"{headers['Nats-Batch-Id']}/{headers['Nats-Batch-Sequence']}"))
        leader = info.cluster.leader
        replicas = info.config.num_replicas
        await nc.close()
        return rows, leader, replicas

    return asyncio.run(run())


class ChatLoop:
    """Chats one after another until stopped; records (finished at, outcome)."""

    def __init__(self, api_url: str) -> None:
        self.http = httpx.Client(base_url=api_url, timeout=60)
        self.outcomes: list[tuple[float, str]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        body = {"model": TINY_MODEL_ID, "messages": MESSAGES, "temperature": 0, "max_tokens": 8}
        while not self._stop.is_set():
            try:
                response = self.http.post("/v1/chat/completions", json=body)
                outcome = "ok" if response.status_code == 200 else f"http {response.status_code}"
            except httpx.TimeoutException:
                outcome = "hung"
            except httpx.HTTPError as error:
                outcome = f"error {error!r}"
            self.outcomes.append((time.monotonic(), outcome))

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(90)
        self.http.close()


def test_compose_topology_serves_chat_and_survives_killing_the_event_stream_leader(tmp_path: Path):
    model = make_tiny_model(tmp_path / "model")
    hub = FakeHub({TINY_MODEL_ID: model})
    hub.start()
    topology = LocalTopology(tmp_path / "compose", {"HF_ENDPOINT": hub.endpoint, "HF_HUB_DISABLE_TELEMETRY": "1"})
    try:
        topology.start()
        http = httpx.Client(base_url=topology.api_url, timeout=120)
        assert http.post("/models/add", json={"model_id": TINY_MODEL_ID}).status_code == 200
        assert http.post("/place_instance", json={"model_id": TINY_MODEL_ID}).status_code == 200
        first = http.post("/v1/chat/completions", json={"model": TINY_MODEL_ID, "messages": MESSAGES, "max_tokens": 8})
        assert first.status_code == 200, first.text

        with ChatLoop(topology.api_url) as chats, AckRecorder(topology.nats_urls) as acks:
            while len(chats.outcomes) < 5 or len(acks.acked) < 20:
                time.sleep(0.1)
            before, leader, replicas = stream_events(topology.nats_urls)
            assert replicas == 3
            topology.services[leader].process.kill()  # kill -9 the server leading EXO_EVENTS
            killed_at = time.monotonic()
            deadline = killed_at + 60
            while not any(at > killed_at + 0.5 and outcome == "ok" for at, outcome in chats.outcomes):
                assert time.monotonic() < deadline, chats.outcomes[-5:]
                time.sleep(0.2)
            resumed_after = min(at for at, o in chats.outcomes if at > killed_at + 0.5 and o == "ok") - killed_at
            count = len(chats.outcomes)
            while len(chats.outcomes) < count + 3 or not acks.acks_between(killed_at + resumed_after, float("inf")):
                time.sleep(0.1)

        survivors = [u for n, u in zip(topology.nats_names, topology.nats_urls) if n != leader]
        after, new_leader, _ = stream_events(survivors)
        assert new_leader != leader
        assert resumed_after < 15
        assert not [o for _, o in chats.outcomes if o == "hung"]
        assert set(before) <= set(after)  # every acknowledged event is still there, at its sequence
        # ...and so is every publish acknowledged just before the kill, during the election and after it.
        assert acks.acks_between(killed_at - 1, killed_at) and acks.missing_from(after) == []
        ids = collections.Counter(msg_id for _, msg_id in after)
        assert [i for i, n in ids.items() if n > 1] == []  # ...and once
        http.close()
    finally:
        topology.stop()
        hub.stop()


def test_exo_started_before_the_jetstream_cluster_has_formed_waits_for_it(tmp_path: Path):
    """compose.yaml waits for healthy servers, but a server can be healthy before the JetStream
    meta group has the peers an R3 stream needs ("no suitable peers for placement"): exo waits
    for the cluster instead of exiting (one full-suite run saw exo-head exit so)."""
    topology = LocalTopology(tmp_path / "compose", {"EXO_CLUSTER_FORMING_WAIT_S": "60"})
    try:
        for name in topology.nats_names[:2]:
            topology.services[name] = topology.nats_service(name).start()
        head = topology.services["exo-head"] = topology.exo_service("exo-head").start()
        deadline = time.monotonic() + 60
        while "waiting for the JetStream cluster's servers" not in head.output():
            assert head.process.poll() is None, head.output()
            assert time.monotonic() < deadline, head.output()
            time.sleep(0.2)
        last = topology.nats_names[2]
        topology.services[last] = topology.nats_service(last).start()
        topology.wait_ready(head)
        # Why it waited depends on how far the two servers got: no meta leader yet (JetStream does
        # not answer) or a meta group short of the third peer ("no suitable peers").
        waited = [line for line in head.output().splitlines() if "waiting for the JetStream cluster's servers" in line]
        assert any("no suitable peers for placement" in line or "did not answer" in line for line in waited), waited
    finally:
        topology.stop()
