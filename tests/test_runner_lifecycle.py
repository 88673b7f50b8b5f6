"""A one-node runner's life end to end, through `exo` as a user runs it: killed mid-stream, its
client gets an error well before the rest of the answer could have been generated (at the pace
measured before the kill) and the runner is back after its back-off, serving exact text;
killed three times in a row before it is ready, the worker stops restarting it and the master
deletes the instance, which a chat's 503 names; a non-streaming request whose client leaves is
cancelled."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx
import pytest

from tests.support.cluster import wait_until
from tests.support.e2e import Reference, exo_serving, place
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


@dataclass
class KilledStream:
    """A stream whose generation was killed after some tokens, measured: its pace before the kill,
    and when and how it ended after it."""

    max_tokens: int
    task_id: str
    tokens_before: int  # tokens streamed before the kill
    per_token: float  # seconds per token while it streamed, before the kill
    tokens_after: int = 0
    ended_after: float = 0.0  # seconds from the kill to the stream's end
    finish: str | None = None
    error: str | None = None
    last_lines: list[str] = field(default_factory=list)

    @property
    def rest_would_take(self) -> float:
        """What the tokens left would have taken at the pace measured before the kill."""
        return (self.max_tokens - self.tokens_before) * self.per_token

    @property
    def bound(self) -> float:
        """Well before the rest could have been generated: the stream ended because of the kill."""
        return self.rest_would_take / 2

    def numbers(self) -> str:
        return (f"{self.tokens_before} tokens at {self.per_token * 1000:.2f} ms/token before the kill, "
                f"{self.tokens_after} after it; the {self.max_tokens - self.tokens_before} left would take "
                f"{self.rest_would_take:.1f} s (bound: half that, {self.bound:.1f} s); the stream ended "
                f"{self.ended_after:.1f} s after the kill with finish {self.finish!r}, error {self.error!r}")

    def assert_ended_by_the_kill(self) -> None:
        assert self.error is not None and self.finish != "length", \
            f"the killed generation did not end with an error: {self.numbers()}; {self.last_lines}"
        assert self.ended_after < self.bound, f"the stream ended too late after the kill: {self.numbers()}"
        assert self.tokens_after < (self.max_tokens - self.tokens_before) / 2, \
            f"the generation went on after the kill: {self.numbers()}"


def stream_and_kill(http: httpx.Client, body: dict, kill: Callable[[], object], warm_up: int = 16,
                    paced: int = 128) -> KilledStream:
    """Stream `body` (with logprobs: every chunk says how many tokens it carries), call `kill` once
    `paced` tokens came after the first `warm_up` ones (their pace is measured: the first tokens'
    chunks can come late, then in a burst), and read the rest: it fails (with the numbers) as soon
    as the stream runs past the bound derived from that pace."""
    body = {**body, "stream": True, "logprobs": True}
    pace_from, pace_tokens, tokens, task_id = None, 0, 0, ""
    with http.stream("POST", "/v1/chat/completions", json=body) as response:
        lines = response.iter_lines()
        for line in lines:
            if not line.startswith("data: {") or not (counted := _tokens_in(data := json.loads(line[6:]))):
                continue
            task_id = task_id or data["id"]
            tokens += counted
            if pace_from is None and tokens >= warm_up:
                pace_from, pace_tokens = time.monotonic(), tokens
            elif pace_from is not None and tokens - pace_tokens >= paced:
                break
        assert pace_from is not None and tokens - pace_tokens >= paced, f"the stream ended after {tokens} tokens"
        kill()
        killed_at = time.monotonic()
        measured = KilledStream(max_tokens=body["max_tokens"], task_id=task_id.removeprefix("chatcmpl-"),
                                tokens_before=tokens, per_token=(killed_at - pace_from) / (tokens - pace_tokens))
        try:
            for line in lines:
                if line.startswith("data: {"):
                    data = json.loads(line[6:])
                    if "error" in data:
                        measured.error = data["error"]["message"]
                    elif data.get("choices"):
                        measured.tokens_after += _tokens_in(data)
                        measured.finish = data["choices"][0]["finish_reason"] or measured.finish
                    measured.last_lines = [*measured.last_lines[-2:], line[:300]]
                measured.ended_after = time.monotonic() - killed_at
                if measured.ended_after >= measured.bound:
                    raise AssertionError(f"the stream still runs after the kill: {measured.numbers()}")
        except httpx.ReadTimeout:
            measured.ended_after = time.monotonic() - killed_at
            raise AssertionError(f"the stream neither went on nor ended after the kill: {measured.numbers()}") from None
    measured.ended_after = time.monotonic() - killed_at
    print(measured.numbers())
    return measured


def _tokens_in(data: dict) -> int:
    choices = data.get("choices") or [{}]
    return len((choices[0].get("logprobs") or {}).get("content") or [])


def next_runner(parent: int, seen: set[int], within: float) -> int:
    return wait_until(lambda: next((pid for pid in runner_pids(parent) if pid not in seen), None), within, 0.02,
                      what="a new runner")


def test_a_runner_killed_mid_stream_then_three_times_in_a_row(tmp_path):
    model = make_tiny_model(tmp_path / "model")
    (tmp_path / "node").mkdir()
    reference = Reference(model)
    with exo_serving(tmp_path / "node", {TINY_MODEL_ID: model}) as node, \
            httpx.Client(base_url=node.url, timeout=120) as http:
        place(http, TINY_MODEL_ID)
        assert chat_until_served(http, 4, 30).status_code == 200
        (runner,) = runner_pids(node.process.pid)
        killed = stream_and_kill(http, {**ASK, "max_tokens": 30_000}, lambda: os.kill(runner, signal.SIGKILL))
        killed.assert_ended_by_the_kill()

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
        wait_until(lambda: http.get("/state").json()["instances"] == {}, 30, 0.2, what="the failed instance deleted")
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

        def ended_task() -> dict | None:
            (task,) = [t for t in http.get("/state").json()["tasks"].values() if t["params"].get("max_tokens") == 30_000]
            return task if task["status"] != "running" else None

        task = wait_until(ended_task, 30, 0.2, what="the abandoned generation ended")
        assert task["status"] == "cancelled"
        assert 0 < task["completion_tokens"] < 30_000
