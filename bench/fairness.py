"""One long prompt arriving while a short request decodes: how long the short one stalls.

In one process (no cluster: this is the runner's own scheduling), on a generated model bigger
than the test one: request A (greedy) decodes; once it has --warm tokens, request B arrives
with a prompt of --long-words words. Reported, per way of serving B, alternating, over --runs:
A's longest gap between two tokens while B is prefilled, A's median gap, and B's time to first
token.

- batch: B joins A's batch (mlx-lm's BatchGenerator: one decode step for A, then one prefill
  chunk of B's prompt, --prefill-step tokens, and again). What unseeded and now seeded requests get.
- single path: B is served alone after A (what seeded requests got before, and what image
  requests and seeded requests on multi-node instances get): A's batch runs on, B waits.
- alone on one thread: B's prompt processed by `stream_generate` with A's next step waiting for
  it, i.e. the stall a prefill on the single path causes to whatever comes after it.

    uv run python -m bench.fairness [--runs 3] [--long-words 250] [--hidden 256] [--layers 4]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench.summary import alternating, print_medians
from exo.core.ids import TaskId
from exo.core.requests import ChatMessage, GenerationParams
from exo.core.types import SamplingDefaults
from exo.runner import prefill
from exo.runner.batch import Batcher
from exo.runner.decoding import Output
from exo.runner.engine import Engine
from tests.support.tiny_model import Dims, make_tiny_model


def chat(text: str, max_tokens: int) -> GenerationParams:
    return GenerationParams(messages=[ChatMessage(role="user", content=text)], max_tokens=max_tokens, temperature=0)


async def batched(engine: Engine, a: GenerationParams, b: GenerationParams, warm: int) -> dict[str, float]:
    loop = asyncio.get_running_loop()
    batcher = Batcher(engine, 8, ThreadPoolExecutor(max_workers=1))
    a_times: list[float] = []
    b_first: list[float] = []
    first_a = batcher.run(loop, a, SamplingDefaults(), lambda _: a_times.append(time.perf_counter()), lambda: False, TaskId("a"))
    while len(a_times) < warm:
        await asyncio.sleep(0.001)
    b_sent = time.perf_counter()
    second = batcher.run(loop, b, SamplingDefaults(), lambda _: b_first.append(time.perf_counter()), lambda: False, TaskId("b"))
    await asyncio.gather(first_a, second)
    return _report(a_times, b_sent, b_first[0])


def serial(engine: Engine, a: GenerationParams, b: GenerationParams, warm: int) -> dict[str, float]:
    """B's prompt alone on the model thread between two of A's tokens: the single path's stall."""
    a_times: list[float] = []
    b_first: list[float] = []
    b_sent = 0.0

    def on_a(_: Output) -> None:
        nonlocal b_sent
        a_times.append(time.perf_counter())
        if len(a_times) == warm:
            b_sent = time.perf_counter()
            engine.generate(b, SamplingDefaults(), lambda _: b_first.append(time.perf_counter()), lambda: len(b_first) > 0)

    engine.generate(a, SamplingDefaults(), on_a, lambda: False)
    return _report(a_times, b_sent, b_first[0])


def _report(a_times: list[float], b_sent: float, b_first: float) -> dict[str, float]:
    gaps = [later - earlier for earlier, later in zip(a_times, a_times[1:])]
    during = [later - earlier for earlier, later in zip(a_times, a_times[1:]) if later > b_sent and earlier < b_first]
    return {"stall_ms": max(during or [0.0]) * 1000, "gap_ms": statistics.median(gaps) * 1000,
            "b_ttft_ms": (b_first - b_sent) * 1000}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--long-words", type=int, default=250)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--warm", type=int, default=10)
    parser.add_argument("--prefill-step", type=int, default=prefill.PREFILL_STEP,
                        help="prompt tokens per prefill chunk, in the batch and alone (exo: 512; mlx-lm: 2048)")
    args = parser.parse_args()
    prefill.PREFILL_STEP = args.prefill_step
    with tempfile.TemporaryDirectory() as folder:
        dims = Dims(hidden=args.hidden, intermediate=args.hidden * 2, layers=args.layers, heads=8, kv_heads=4)
        engine = Engine()
        engine.load(str(make_tiny_model(Path(folder) / "model", dims)))
        a = chat("Tell me about the sea.", 400)
        b_tokens = len(engine.encode(engine.prompt_for(chat(" ".join(["hello0b"] * args.long_words), 1))))
        results: dict[str, list[dict[str, float]]] = {"batch": [], "single path": []}
        for run, way in alternating(list(results), args.runs):
            # A prompt of its own per run and way: a prompt seen before would be a cache hit.
            b = chat(" ".join([f"hello{run}{way[0]}"] * args.long_words), 8)
            outcome = asyncio.run(batched(engine, a, b, args.warm)) if way == "batch" else serial(engine, a, b, args.warm)
            results[way].append(outcome)
            print(f"run {run + 1} {way}: {outcome}", flush=True)
    print(f"\nA: 400 greedy tokens; B: a prompt of ~{b_tokens} tokens arriving after A's {args.warm}th token; "
          f"model hidden {args.hidden}, {args.layers} layers; prefill step {args.prefill_step}; "
          f"{args.runs} runs each, median [min-max]")
    print_medians([("B served", 12), ("A stalled ms", 20), ("A median gap ms", 18), ("B TTFT ms", 20)],
                  results, ["stall_ms", "gap_ms", "b_ttft_ms"])


if __name__ == "__main__":
    main()
