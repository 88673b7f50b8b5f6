"""A runner that stops making progress while it has work (SIGSTOP: a stuck model thread looks
the same to the worker) is found within EXO_RUNNER_STALL_S: its request ends with an error that
names the cause, the runner is killed and restarted, and the next request is served."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time

import httpx
import pytest

from tests.support.cluster import wait_until
from tests.support.e2e import exo_serving, place
from tests.support.exo_process import runner_pids
from tests.support.tiny_model import TINY_MODEL_ID, make_tiny_model

pytestmark = pytest.mark.slow

STALL_S = 3


def test_a_hung_runner_fails_its_request_within_the_bound_and_comes_back(tmp_path):
    model = make_tiny_model(tmp_path / "model")
    (tmp_path / "node").mkdir()
    with exo_serving(tmp_path / "node", {TINY_MODEL_ID: model}, {"EXO_RUNNER_STALL_S": str(STALL_S)}) as node, \
            httpx.Client(base_url=node.url, timeout=120) as http:
        instance_id = place(http, TINY_MODEL_ID)
        ask = {"model": TINY_MODEL_ID, "messages": [{"role": "user", "content": "Hello"}], "temperature": 0}
        assert http.post("/v1/chat/completions", json={**ask, "max_tokens": 4}).status_code == 200
        (runner,) = runner_pids(node.process.pid)
        body = {**ask, "max_tokens": 30_000, "stream": True}
        # No read waits past the bound: a stopped runner sends nothing, so a broken watchdog shows
        # as a read timeout here (or as lines still coming at the bound), reported as such.
        bound = STALL_S + 10
        rest: list[str] = []
        with http.stream("POST", "/v1/chat/completions", json=body, timeout=httpx.Timeout(120, read=bound)) as response:
            lines = response.iter_lines()
            next(line for line in lines if line.startswith("data: {")  # the first chunk with text
                 and json.loads(line.removeprefix("data: "))["choices"][0]["delta"].get("content"))
            os.kill(runner, signal.SIGSTOP)
            stopped_at = time.monotonic()
            try:
                for line in lines:
                    rest.append(line)
                    assert time.monotonic() - stopped_at < bound, \
                        f"the stream of a hung runner still runs {bound} s after SIGSTOP (stall {STALL_S} s): {rest[-3:]}"
            except httpx.ReadTimeout:
                pytest.fail(f"the hung runner was not killed within stall + 10 s ({bound} s): its stream sent nothing "
                            f"for {time.monotonic() - stopped_at:.1f} s after SIGSTOP and did not end; last lines: "
                            f"{rest[-3:]}")
            finally:
                with contextlib.suppress(ProcessLookupError):  # killed by the watchdog, unless it is broken
                    os.kill(runner, signal.SIGCONT)
        waited = time.monotonic() - stopped_at
        errors = [line for line in rest if '"error"' in line]
        assert errors and "the runner was hung: no progress for" in errors[-1], rest[-3:]
        assert waited < bound, f"the hung runner's request ended {waited:.1f} s after SIGSTOP (bound {bound} s)"

        def replaced_and_ready() -> bool:
            fresh = [pid for pid in runner_pids(node.process.pid) if pid != runner]
            return bool(fresh) and http.get(f"/instance/{instance_id}").json().get("status") == "ready"

        wait_until(replaced_and_ready, 60, interval=0.2, what="a new runner process ready after the hung one was killed")
        assert runner not in runner_pids(node.process.pid)
        reply = http.post("/v1/chat/completions", json={**ask, "max_tokens": 4})
        assert reply.status_code == 200, reply.text
