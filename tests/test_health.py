"""/health says whether this node can serve (a readiness probe) and names what is wrong when it
cannot; /livez says only that the process runs. A request while the bus is away is a 503 with
Retry-After and the cause within seconds, in every surface's shape, never a 500 after a 30 s
publish timeout. The API runs in this process over a nats-server of its own, stopped and started
(or paused) under it."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import yaml
from aiohttp.test_utils import TestServer

from exo.api.app import build_app
from exo.api.context import ApiContext
from exo.api.outcomes import CommandOutcomes
from exo.bus.catch_up import catch_up
from exo.bus.connection import connect
from exo.bus.provision import provision
from exo.bus.readiness import LagWatch, quorum_problem
from exo.bus.server.embedded import EmbeddedNats
from exo.bus.server.jetstream_cluster import redundancy
from exo.core.ids import NodeId
from exo.models.cards import load_builtin_cards
from exo.resources import builtin_cards_dir

MODEL = "mlx-community/Llama-3.2-1B-Instruct-4bit"  # a built-in card: a chat for it reaches the bus
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
GONE = re.compile(r"not connected to NATS since (\d+) s")
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
async def api(fresh_server: EmbeddedNats, tmp_path: Path) -> AsyncIterator[httpx.AsyncClient]:
    nc = await connect([fresh_server.url], "exo-test")
    await provision(nc)
    view, _ = await catch_up(nc)
    ctx = ApiContext(nc, view, CommandOutcomes(nc, view), load_builtin_cards(builtin_cards_dir()), NodeId("node-a"),
                     tmp_path)
    server = TestServer(build_app(ctx))
    await server.start_server()
    async with httpx.AsyncClient(base_url=str(server.make_url("")), timeout=60) as http:
        yield http
    await server.close()
    await view.stop()
    await nc.close()


async def health_until(http: httpx.AsyncClient, status: int, timeout: float) -> httpx.Response:
    deadline = time.monotonic() + timeout
    while (answer := await http.get("/health")).status_code != status:
        assert time.monotonic() < deadline, f"/health still {answer.status_code} after {timeout} s: {answer.text}"
        await asyncio.sleep(0.1)
    return answer


async def test_health_is_503_naming_a_lost_connection_and_200_once_back_while_livez_stays_200(api, fresh_server):
    ok = await api.get("/health")
    assert ok.status_code == 200
    assert ok.json() == {"status": "ok", "node_id": "node-a", "last_seq": ok.json()["last_seq"], "nats_connected": True,
                         "suspect_nodes": [], "redundancy": redundancy(1)}
    assert redundancy(1).startswith("none: the event log has 1 replica, and losing its NATS server stops the cluster")

    fresh_server.stop()
    stopped = time.monotonic()
    degraded = await health_until(api, 503, 10)
    await asyncio.sleep(3)  # "since" counts from the loss, not from the question
    later = await api.get("/health")
    body = later.json()
    assert later.status_code == 503 and body["status"] == "degraded" and body["nats_connected"] is False
    since = GONE.fullmatch(body["problem"])
    assert since, body
    assert abs(int(since[1]) - (time.monotonic() - stopped)) <= 1.5, (body, time.monotonic() - stopped)
    assert set(body) == {"status", "node_id", "last_seq", "nats_connected", "suspect_nodes", "redundancy", "problem"}
    assert degraded.json()["problem"]
    livez = await api.get("/livez")
    assert livez.status_code == 200 and livez.json() == {"status": "alive"}

    await fresh_server.start()  # the same port and store
    back = await health_until(api, 200, 15)
    assert back.json()["status"] == "ok" and back.json()["nats_connected"] is True
    assert (await api.get("/livez")).json() == {"status": "alive"}


async def jetstream_api_calls(server: EmbeddedNats) -> int:
    """How many JetStream API requests the server has answered (its monitoring endpoint counts them)."""
    async with httpx.AsyncClient(timeout=5) as http:
        return int((await http.get(f"{server.monitor_url}/jsz")).json()["api"]["total"])


async def test_a_suspect_node_is_named_by_health_and_is_no_reason_for_503(api, fresh_server):
    from exo.bus.event_log import EventLog
    from exo.core.events import LeaderElected, NodeRegistered, NodeSuspected
    from exo.core.types import NodeInfo

    nc = await connect([fresh_server.url], "exo-test-writer")
    log = EventLog(nc)
    term = await log.append(LeaderElected(node_id=NodeId("master"), lease_revision=1), event_id="e1")
    for n, event in enumerate([NodeRegistered(node=NodeInfo(node_id=NodeId("b" * 32), name="mini")),
                               NodeRegistered(node=NodeInfo(node_id=NodeId("c" * 32), name="studio")),
                               NodeSuspected(node_id=NodeId("b" * 32), at=1000.0, term=term)]):
        last = await log.append(event, event_id=f"e{n + 2}")
    await nc.close()
    deadline = time.monotonic() + 10
    while (answer := await api.get("/health")).json()["last_seq"] < last:
        assert time.monotonic() < deadline, answer.text
        await asyncio.sleep(0.05)
    assert (answer.status_code, answer.json()["status"], answer.json()["suspect_nodes"]) == (200, "ok", ["mini"])


async def test_health_asks_jetstream_at_most_once_per_moment_however_often_it_is_asked(api, fresh_server):
    await api.get("/health")  # the stream was just asked: the next second's answers reuse it
    before = await jetstream_api_calls(fresh_server)
    answers = await asyncio.gather(*(api.get("/health") for _ in range(20)))
    answers += [await api.get("/health") for _ in range(10)]
    assert [a.status_code for a in answers] == [200] * 30
    assert await jetstream_api_calls(fresh_server) - before <= 1
    await asyncio.sleep(1.6)  # past the cached answer's age: asked again, once
    before = await jetstream_api_calls(fresh_server)
    await asyncio.gather(*(api.get("/health") for _ in range(20)))
    assert await jetstream_api_calls(fresh_server) - before == 1


async def test_a_chat_while_the_bus_is_away_is_a_503_with_retry_after_in_every_surface_shape(api, fresh_server, caplog):
    fresh_server.stop()
    await health_until(api, 503, 10)  # the client has seen the loss: a request now waits out the reconnect grace
    started = time.monotonic()
    chat = await api.post("/v1/chat/completions", json=CHAT)
    took = time.monotonic() - started
    assert took < 5, f"the chat took {took:.1f} s to be refused"
    assert chat.status_code == 503 and chat.headers["Retry-After"] == "5"
    error = chat.json()["error"]
    assert GONE.search(error["message"]) and error["message"].startswith("the message bus (NATS) is unavailable: ")
    assert (error["type"], error["code"], error["param"]) == ("service_unavailable", "bus_unavailable", None)

    messages = await api.post("/v1/messages", json={**CHAT, "max_tokens": 4})
    assert messages.status_code == 503 and messages.headers["Retry-After"] == "5"
    assert messages.json()["type"] == "error" and messages.json()["error"]["type"] == "overloaded_error"
    assert GONE.search(messages.json()["error"]["message"])
    ollama = await api.post("/api/chat", json={"model": MODEL, "messages": CHAT["messages"], "stream": False})
    assert ollama.status_code == 503 and ollama.headers["Retry-After"] == "5" and GONE.search(ollama.json()["error"])
    assert (await api.get("/livez")).status_code == 200
    said = [r for r in caplog.records if r.name == "exo.api.bus_outage"]  # three refusals, one line, no traceback
    assert [(r.levelname, r.exc_info) for r in said] == [("WARNING", None)]
    assert GONE.search(said[0].getMessage()) and said[0].getMessage().startswith("answered 503, the message bus")


@pytest.mark.slow  # waits out a request's publish patience (10 s)
async def test_a_paused_server_makes_health_answer_within_a_second_and_a_chat_a_503_within_the_patience(
        api, fresh_server):
    assert fresh_server.process is not None
    os.kill(fresh_server.process.pid, signal.SIGSTOP)  # connected, but nothing answers: a JetStream without quorum looks so
    try:
        started = time.monotonic()
        health = await api.get("/health")
        assert time.monotonic() - started < 1.5
        assert health.status_code == 503 and health.json()["nats_connected"] is True
        assert health.json()["problem"] == "JetStream cannot serve EXO_EVENTS: no answer within 1 s"
        started = time.monotonic()
        chat = await api.post("/v1/chat/completions", json=CHAT)
        took = time.monotonic() - started
        assert chat.status_code == 503 and chat.headers["Retry-After"] == "5"
        assert "could not publish to EXO_COMMANDS for 10 s" in chat.json()["error"]["message"]
        assert 10 <= took < 14, f"refused after {took:.1f} s"
    finally:
        os.kill(fresh_server.process.pid, signal.SIGCONT)
    await health_until(api, 200, 10)


async def test_compose_checks_the_api_node_with_health(api, fresh_server):
    """compose.yaml's health check of exo-head, run as written against this API: it passes while the
    node can serve and fails while its NATS is away."""
    check = yaml.safe_load((REPO / "compose.yaml").read_text())["services"]["exo-head"]["healthcheck"]["test"]
    assert check[0] == "CMD" and "http://localhost:52415/health" in check[-1]
    command = [sys.executable if part == "python" else part.replace("localhost:52415", str(api.base_url)[7:].rstrip("/"))
               for part in check[1:]]
    assert await exit_code(command) == 0
    fresh_server.stop()
    await health_until(api, 503, 10)
    assert await exit_code(command) != 0


async def exit_code(command: list[str]) -> int:
    """The command's exit code; run beside this loop, which serves the API it asks."""
    process = await asyncio.create_subprocess_exec(*command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return await asyncio.wait_for(process.wait(), 10)


def test_quorum_is_a_majority_of_the_wanted_replicas_with_a_leader():
    assert quorum_problem("EXO_EVENTS", 1, "exo-embedded", []) == ""
    assert quorum_problem("EXO_EVENTS", 3, "n1", [True, False]) == ""
    assert quorum_problem("EXO_EVENTS", 3, "n1", [False, False]) == "no quorum for EXO_EVENTS: 1 of 3 replicas current"
    assert quorum_problem("EXO_EVENTS", 2, "n1", [False]) == "no quorum for EXO_EVENTS: 1 of 2 replicas current"
    assert quorum_problem("EXO_EVENTS", 3, None, [True, True]) == \
        "no quorum for EXO_EVENTS: no leader, 2 of 3 replicas current"


def test_state_behind_the_log_is_a_problem_only_once_stuck_for_the_allowed_time():
    watch = LagWatch(allowed_s=10)
    assert watch.problem(folded=5, log_last=8, now=100) == ""  # events in flight
    assert watch.problem(folded=7, log_last=9, now=109) == ""
    assert watch.problem(folded=7, log_last=9, now=111) == \
        "State is behind the event log: folded up to 7, the log held 8 11 s ago"
    assert watch.problem(folded=8, log_last=12, now=112) == ""  # it reached what it trailed: a new wait starts
    assert watch.problem(folded=11, log_last=12, now=121) == ""
    assert watch.problem(folded=12, log_last=12, now=140) == ""
