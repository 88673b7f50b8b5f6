"""A one-node runner's life end to end, through `exo` as a user runs it: killed mid-stream, its
client gets an error at once and the runner is back after its back-off, serving exact text;
killed three times in a row before it is ready, the worker stops restarting it and the master
deletes the instance, which a chat's 503 names; a non-streaming request whose client leaves is
cancelled."""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest

from tests.e2e_support import Reference, exo_serving, place
from tests.support.tiny_model import TINY_MODEL_ID, make_tiny_model
from tests.test_hung_runner import runner_pids

pytestmark = pytest.mark.slow

MESSAGES = [{"role": "user", "content": "Tell me about the sea."}]
ASK = {"model": TINY_MODEL_ID, "messages": MESSAGES, "temperature": 0}


def chat_until_served(http: httpx.Client, max_tokens: int, within: float) -> httpx.Response:
    deadline = time.monotonic() + within
    while True:
        reply = http.post("/v1/chat/completions", json={**ASK, "max_tokens": max_tokens})
        if reply.status_code == 200 or time.monotonic() > deadline:
            return reply
        time.sleep(0.2)


def next_runner(parent: int, seen: set[int], within: float) -> int:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        fresh = [pid for pid in runner_pids(parent) if pid not in seen]
        if fresh:
            return fresh[0]
        time.sleep(0.02)
    raise AssertionError(f"no new runner within {within} s")


def test_a_runner_killed_mid_stream_then_three_times_in_a_row(tmp_path):
    model = make_tiny_model(tmp_path / "model")
    (tmp_path / "node").mkdir()
    reference = Reference(model)
    with exo_serving(tmp_path / "node", {TINY_MODEL_ID: model}) as node, \
            httpx.Client(base_url=node.url, timeout=120) as http:
        place(http, TINY_MODEL_ID)
        assert chat_until_served(http, 4, 30).status_code == 200
        (runner,) = runner_pids(node.process.pid)
        with http.stream("POST", "/v1/chat/completions", json={**ASK, "max_tokens": 30_000, "stream": True}) as response:
            lines = response.iter_lines()
            next(line for line in lines if '"content"' in line and '"content": ""' not in line)
            os.kill(runner, signal.SIGKILL)
            killed_at = time.monotonic()
            rest = list(lines)
        assert time.monotonic() - killed_at < 5
        errors = [line for line in rest if '"error"' in line]
        assert errors and not any('"finish_reason": "length"' in line for line in rest), rest[-3:]

        # Back after its back-off (1 s after a first failure), with exact text.
        reply = chat_until_served(http, 8, 60)
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["message"]["content"] == reference.chat(MESSAGES, 8)
        (current,) = runner_pids(node.process.pid)
        seen = {runner, current}

        # Three failures in a row: the ready runner, then each restarted one before it is ready.
        os.kill(current, signal.SIGKILL)
        for _ in range(2):
            fresh = next_runner(node.process.pid, seen, 30)
            seen.add(fresh)
            os.kill(fresh, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while http.get("/state").json()["instances"] and time.monotonic() < deadline:
            time.sleep(0.2)
        assert http.get("/state").json()["instances"] == {}
        refused = http.post("/v1/chat/completions", json={**ASK, "max_tokens": 4})
        assert refused.status_code == 503, refused.text
        message = refused.json()["error"]["message"]
        assert "its last instance was deleted" in message and "failed" in message, message
        assert not [pid for pid in runner_pids(node.process.pid) if pid not in seen]  # and none was started again


def test_a_non_streaming_request_whose_client_leaves_is_cancelled(tmp_path):
    model = make_tiny_model(tmp_path / "model")
    (tmp_path / "node").mkdir()
    with exo_serving(tmp_path / "node", {TINY_MODEL_ID: model}) as node, \
            httpx.Client(base_url=node.url, timeout=120) as http:
        place(http, TINY_MODEL_ID)
        assert chat_until_served(http, 4, 30).status_code == 200
        with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes its connection
            httpx.post(f"{node.url}/v1/chat/completions", json={**ASK, "max_tokens": 30_000}, timeout=2)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            (task,) = [t for t in http.get("/state").json()["tasks"].values() if t["params"].get("max_tokens") == 30_000]
            if task["status"] != "running":
                break
            time.sleep(0.2)
        assert task["status"] == "cancelled"
        assert 0 < task["completion_tokens"] < 30_000
