"""The runner's warm-up (exo/runner/process.py Runner._warm_up): before it says ready it has run
the greedy and the sampled kernels of the single path and of a batch, so its first request does not
wait while MLX compiles them (seconds on a CPU), and nothing it leaves behind changes what requests get.

MLX keeps the CPU kernels it compiles on disk under the temp dir (mlx/<version>/cpu/), shared by
every process on the machine: a runner given a temp dir of its own is a node's first runner."""

from __future__ import annotations

import asyncio
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from exo.core.requests import ChatMessage, GenerationParams
from exo.runner.decoding import GenerationResult, Output
from exo.runner.process import Runner
from exo.runner.protocol import Generate
from tests.support.tiny_model import make_tiny_model

pytestmark = pytest.mark.slow  # real inference; one test compiles every kernel afresh (seconds)

# What a first request may take after the warm-up: tens of ms measured (4 tokens, tiny model, 2 busy
# cores); one sampling kernel left to compile took 0.6-2 s there, all of them (no warm-up) 3.5-5 s.
FIRST_REQUEST_S = 0.5

# A runner in a fresh process: load, warm up, then its first requests of each kind (sampled as
# issue #46 sent it, alone and two in one batch; greedy), timed, and the kernels each compiled.
FIRST_REQUESTS = r"""
import asyncio, io, json, os, sys, time
from pathlib import Path
from exo.core.requests import ChatMessage, GenerationParams
from exo.runner.process import Runner
from exo.runner.protocol import Generate, Load, WarmUp, report_decoder

def kernels():
    return {str(p) for p in Path(os.environ["TMPDIR"]).glob("mlx/*/cpu/*.so")}

def chat(text, **sampling):
    return GenerationParams(messages=[ChatMessage(role="user", content=text)], max_tokens=16, **sampling)

async def main():
    reports, loop = io.BytesIO(), asyncio.get_running_loop()
    runner = Runner(None, reports)
    await runner._serve(loop, Load(model_path=sys.argv[1]))
    started = time.perf_counter()
    await runner._serve(loop, WarmUp())
    out = {"warm_up_s": time.perf_counter() - started, "reports": reports.getvalue().decode().splitlines()}
    warmed = kernels()
    out["kernels"] = len(warmed)
    sampled = {"temperature": 0.7, "top_p": 0.9}
    firsts = {"sampled": [chat("Hello", **sampled)],
              "two sampled": [chat("Hi", **sampled), chat("Tell me about the sea.", **sampled)],
              "greedy": [chat("Hello", temperature=0.0)]}
    for name, requests in firsts.items():
        started = time.perf_counter()
        await asyncio.gather(*(runner._start(loop, Generate(task_id=f"{name} {n}", params=params), lambda _: None)
                               for n, params in enumerate(requests)))
        out[name] = time.perf_counter() - started
    out["compiled after"] = sorted(kernels() - warmed)
    print(json.dumps(out), flush=True)
    os._exit(0)  # the runner's threads are not shut down: this process only measures

asyncio.run(main())
"""


def test_the_first_requests_after_a_fresh_runners_warm_up_compile_nothing(tmp_path: Path):
    model = make_tiny_model(tmp_path / "model")
    fresh = tmp_path / "tmp"  # no kernel compiled yet, as on a new node
    fresh.mkdir()
    run = subprocess.run([sys.executable, "-c", FIRST_REQUESTS, str(model)], capture_output=True, text=True,
                         timeout=240, env={**os.environ, "TMPDIR": str(fresh)}, cwd=Path(__file__).parent.parent)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.splitlines()[-1])
    loaded, warmed_up = (json.loads(line) for line in out["reports"])
    assert loaded == {"op": "loaded"} and warmed_up["op"] == "warmed_up"
    assert 0 < warmed_up["seconds"] <= round(out["warm_up_s"], 3)  # what the ready line says (tests/test_end_to_end.py)
    assert out["kernels"] > 0  # the warm-up compiled them here, into the fresh temp dir
    assert out["compiled after"] == []
    assert {name: out[name] < FIRST_REQUEST_S for name in ("sampled", "two sampled", "greedy")} == {
        "sampled": True, "two sampled": True, "greedy": True}, out


def chat(text: str) -> GenerationParams:
    return GenerationParams(messages=[ChatMessage(role="user", content=text)], max_tokens=12, temperature=0.0)


def test_the_warm_up_leaves_the_prompt_cache_and_the_next_answer_as_they_were(tmp_path: Path):
    runner = Runner(None, io.BytesIO())  # type: ignore[arg-type]  # nothing here publishes
    runner._engine.load(str(make_tiny_model(tmp_path / "model")))

    def answer(task_id: str) -> tuple[str, int, int]:
        out: list[Output] = []

        async def run() -> GenerationResult:
            return await runner._start(asyncio.get_running_loop(), Generate(task_id=task_id, params=chat("Hello")),
                                       out.append)

        result = asyncio.run(run())
        runner._mlx_thread.submit(lambda: None).result()  # the batch has kept its cache (after the result)
        return "".join(o.text for o in out), result.prompt_tokens, result.cached_tokens

    first = answer("first")
    before = runner._engine.prompt_cache.stats()
    assert before.entries == 1  # the first answer's cache is kept: what the warm-up must leave alone
    runner._warm_up()
    assert runner._engine.prompt_cache.stats() == before
    text, prompt_tokens, cached = answer("second")
    assert (text, prompt_tokens) == first[:2] and cached == prompt_tokens - 1  # all but the last prompt token reused
