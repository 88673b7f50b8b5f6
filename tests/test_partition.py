"""A worker partitioned away from NATS (its link through a loopback proxy cut) for longer than
the node timeout: the master times it out and deletes the instance that used it, whose placement
then waits (two nodes needed) with the reason; after the link heals, the worker comes back, its
State converges to the log's, the placement is made again by itself and the model serves again."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest

from exo.core.state import encode_state
from tests.support.cluster import NatsServer, node_process, replay, state_of, wait_until
from tests.support.e2e import Reference
from tests.support.exo_process import free_port_range, interrupt_all, start_all
from tests.support.tcp_proxy import TcpProxy
from tests.support.tiny_model import Dims, make_tiny_model

pytestmark = pytest.mark.slow

NODE_TIMEOUT_S = 4.0
MODEL = "local/tiny4"
PROMPT = [{"role": "user", "content": "and the tide came in"}]


def _worker_env() -> dict[str, str]:
    first = free_port_range(21)
    return {"EXO_HEARTBEAT_S": "0.5", "EXO_ADVERTISE_ADDRESSES": "127.0.0.1", "EXO_RING_PORTS": f"{first}-{first + 20}"}


def test_a_partitioned_worker_is_timed_out_then_rejoins_and_converges(tmp_path: Path):
    model_dir = make_tiny_model(tmp_path / "model", Dims(layers=4))
    nats = NatsServer(tmp_path / "nats")
    port = int(re.search(r":(\d+)$", nats.url).group(1))
    proxy = TcpProxy("127.0.0.1", port).start()
    through_proxy = nats.url.replace(f"127.0.0.1:{port}", proxy.url.split("://", 1)[1])  # with the credentials
    head, steady, cut_off = start_all([
        node_process(tmp_path, "head", nats.url, "--no-worker", "--node-timeout", str(NODE_TIMEOUT_S),
                     env={"EXO_HEARTBEAT_S": "0.5"}),
        node_process(tmp_path, "steady", nats.url, "--no-master", "--no-api", env=_worker_env()),
        node_process(tmp_path, "cut-off", through_proxy, "--no-master", env=_worker_env())])  # API on: we read its State
    http = httpx.Client(base_url=head.url, timeout=120)
    try:
        wait_until(lambda: len(state_of(head).nodes) == 2, 30, what="both workers registered")
        assert http.post("/models/add", json={"model_id": MODEL, "path": str(model_dir)}).status_code == 200
        expected = Reference(model_dir).chat(PROMPT, 16)
        _place_on_both_and_chat(http, expected)

        (old_instance,) = state_of(head).instances
        proxy.cut()
        wait_until(lambda: len(state_of(head).nodes) == 1, NODE_TIMEOUT_S + 15, what="the cut-off worker timed out")
        assert state_of(head).instances == {}
        # Its placement waits, with the reason: two nodes needed, one left.
        waiting = lambda: next(iter(state_of(head).desires.values())).waiting  # noqa: E731
        wait_until(lambda: "min_nodes=2 but the cluster has 1 node(s)" in waiting(), 10, what="the desire waits")
        answer = http.post("/v1/chat/completions", json={"model": MODEL, "messages": PROMPT, "max_tokens": 4})
        message = answer.json()["error"]["message"]
        assert answer.status_code == 503 and "timed out" in message and "min_nodes=2" in message, message

        proxy.heal()
        wait_until(lambda: len(state_of(head).nodes) == 2, 60, what="the worker back after the heal")
        old_runners = lambda state: [r for r in state.runners.values() if r.instance_id == old_instance]  # noqa: E731
        wait_until(lambda: not old_runners(state_of(cut_off)) and state_of(cut_off).instances, 60,
                   what="the old instance's runners gone on the rejoined worker, a new instance placed by itself")
        rejoined = state_of(cut_off)
        replayed, _ = replay(nats.url, rejoined.last_seq)
        assert encode_state(replayed) == encode_state(rejoined)  # converged: the log's State, exactly
        wait_until(lambda: http.get(f"/instance/{next(iter(state_of(head).instances))}").json().get("status") == "ready",
                   120, interval=0.5, what="the replacement ready")
        _chat_exactly(http, expected)
    finally:
        http.close()
        interrupt_all([cut_off, steady, head])
        proxy.stop()
        nats.stop()


def _place_on_both_and_chat(http: httpx.Client, expected: str) -> None:
    placed = http.post("/place_instance", json={"model_id": MODEL, "sharding": "tensor", "min_nodes": 2, "wait": 120})
    assert placed.status_code == 200, placed.text
    _chat_exactly(http, expected)


def _chat_exactly(http: httpx.Client, expected: str) -> None:
    answer = http.post("/v1/chat/completions", json={"model": MODEL, "messages": PROMPT, "max_tokens": 16,
                                                     "temperature": 0})
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["message"]["content"] == expected
