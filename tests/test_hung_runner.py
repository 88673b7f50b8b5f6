"""A runner that stops making progress while it has work (SIGSTOP: a stuck model thread looks
the same to the worker) is found within EXO_RUNNER_STALL_S: its request ends with an error that
names the cause, the runner is killed and restarted, and the next request is served."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from tests.e2e_support import exo_serving, place
from tests.support.tiny_model import TINY_MODEL_ID, make_tiny_model

pytestmark = pytest.mark.slow

STALL_S = 3


def runner_pids(parent: int) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ")
        except (OSError, IndexError, ValueError):
            continue
        if ppid == parent and b"exo.runner" in command:
            pids.append(int(entry.name))
    return pids


def test_a_hung_runner_fails_its_request_within_the_bound_and_comes_back(tmp_path):
    model = make_tiny_model(tmp_path / "model")
    (tmp_path / "node").mkdir()
    with exo_serving(tmp_path / "node", {TINY_MODEL_ID: model}, {"EXO_RUNNER_STALL_S": str(STALL_S)}) as node, \
            httpx.Client(base_url=node.url, timeout=120) as http:
        place(http, TINY_MODEL_ID)
        ask = {"model": TINY_MODEL_ID, "messages": [{"role": "user", "content": "Hello"}], "temperature": 0}
        assert http.post("/v1/chat/completions", json={**ask, "max_tokens": 4}).status_code == 200
        (runner,) = runner_pids(node.process.pid)
        body = {**ask, "max_tokens": 30_000, "stream": True}
        with http.stream("POST", "/v1/chat/completions", json=body) as response:
            lines = response.iter_lines()
            next(line for line in lines if '"content"' in line and '"content": ""' not in line)
            os.kill(runner, signal.SIGSTOP)
            stopped_at = time.monotonic()
            rest = list(lines)
        waited = time.monotonic() - stopped_at
        errors = [line for line in rest if '"error"' in line]
        assert errors and "the runner was hung: no progress for" in errors[-1], rest[-3:]
        assert waited < STALL_S + 4, waited
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            reply = http.post("/v1/chat/completions", json={**ask, "max_tokens": 4})
            if reply.status_code == 200:
                break
            time.sleep(0.5)
        assert reply.status_code == 200, reply.text
        assert runner not in runner_pids(node.process.pid)  # a new runner process serves it
