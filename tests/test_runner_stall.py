"""A long prefill is progress, not a hang. The model thread beats after every prefill chunk
(exo/runner/prefill.py), so a prompt whose prefill takes several times EXO_RUNNER_STALL_S in all,
in chunks that mlx-lm's default 2,048-token step would make longer than that, is answered exactly
as mlx-lm answers it, in the batch and on the single path; a runner stopped in the middle of such
a prefill is still taken for hung."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.support.e2e import Reference, exo_serving, place
from tests.support.tiny_model import TINY_MODEL_ID, Dims, make_tiny_model
from tests.test_hung_runner import runner_pids

pytestmark = pytest.mark.slow

STALL_S = 4.0
# On the 2-core test machine the prompt below (~4,550 tokens) takes ~8 s to prefill; its second
# 2,048-token chunk alone takes ~7 s (mlx-lm's step: over STALL_S, taken for hung), a 512-token one
# at most ~2 s (with the pulse's second, under STALL_S).
DIMS = Dims(hidden=128, intermediate=256, layers=4, heads=4, kv_heads=2)
WORDS = 660
MAX_TOKENS = 8


def long_chat(first_word: str) -> list[dict[str, str]]:
    """A prompt nothing cached shares a prefix with (`first_word`)."""
    return [{"role": "user", "content": first_word + " " + " ".join(f"river{n % 89} stone" for n in range(WORDS))}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("model") / "model", DIMS)


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> Reference:
    """One for both paths: the long prompt's answer (a prefill of seconds) is computed once."""
    return Reference(model_dir)


@pytest.mark.parametrize("path", ["batch", "single"])
def test_a_long_prefill_is_answered_exactly_and_a_runner_stopped_in_one_is_killed(tmp_path, model_dir, reference, path):
    env = {"EXO_RUNNER_STALL_S": str(STALL_S)} | ({"EXO_MAX_BATCH": "1"} if path == "single" else {})
    with exo_serving(tmp_path, {TINY_MODEL_ID: model_dir}, env) as node, \
            httpx.Client(base_url=node.url, timeout=300) as http:
        place(http, TINY_MODEL_ID)
        ask, messages = {"model": TINY_MODEL_ID, "max_tokens": MAX_TOKENS, "temperature": 0}, long_chat("Once")
        started = time.monotonic()
        reply = http.post("/v1/chat/completions", json={**ask, "messages": messages})
        took = time.monotonic() - started
        assert reply.status_code == 200, reply.text  # not a 424: "the runner was hung"
        assert reply.json()["choices"][0]["message"]["content"] == reference.chat(messages, MAX_TOKENS)
        assert took > 2 * STALL_S, f"the prompt took {took:.1f} s: too short to outlast the stall limit"

        (runner,) = runner_pids(node.process.pid)
        with ThreadPoolExecutor(1) as background:
            stopped = background.submit(http.post, "/v1/chat/completions", json={**ask, "messages": long_chat("Twice")})
            time.sleep(STALL_S / 2)  # in its prefill
            os.kill(runner, signal.SIGSTOP)
            try:
                answer = stopped.result(timeout=STALL_S + 10)
            except TimeoutError:
                pytest.fail(f"the runner stopped in its prefill was not taken for hung within {STALL_S + 10} s")
            finally:
                with contextlib.suppress(ProcessLookupError):  # killed by the watchdog, unless it is broken
                    os.kill(runner, signal.SIGCONT)
        assert answer.status_code == 424 and "the runner was hung: no progress for" in answer.text, answer.text
