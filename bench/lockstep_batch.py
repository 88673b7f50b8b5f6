"""What lockstep batching costs a multi-node instance: one request through the runner's Batcher
(a BatchStep broadcast before every step) vs the single path (Engine.generate), on two ranks in
separate processes (MLX ring group on loopback), tensor and pipeline, in one run; one process
without a group for reference. Greedy, the same prompt, tokens/s over the whole request.

    uv run python -m bench.lockstep_batch [--hidden 512] [--layers 8] [--max-tokens 128] [--repeat 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from exo.core.ids import TaskId
from exo.core.requests import ChatMessage, GenerationParams
from exo.core.types import SamplingDefaults
from exo.runner.batch import Batcher
from exo.runner.engine import Engine
from exo.runner.follower import follow
from exo.runner.protocol import RankSetup
from tests.support.exo_process import free_port
from tests.support.tiny_model import Dims, make_tiny_model

PROMPT = "Write a short story about a lighthouse keeper and the sea."


async def measure(engine: Engine, max_tokens: int, repeat: int) -> dict[str, float]:
    """Median tokens/s of `repeat` requests per path, the paths taking turns."""
    loop = asyncio.get_running_loop()
    model_thread = ThreadPoolExecutor(max_workers=1)
    batcher = Batcher(engine, 8, model_thread)
    params = GenerationParams(messages=[ChatMessage(role="user", content=PROMPT)], temperature=0, max_tokens=max_tokens)
    speeds: dict[str, list[float]] = {"batch": [], "single": []}
    for _ in range(repeat):
        for path in speeds:
            start = time.perf_counter()
            if path == "batch":
                result = await batcher.run(loop, params, SamplingDefaults(), lambda _: None, lambda: False, TaskId("bench"))
            else:
                result = await loop.run_in_executor(model_thread, engine.generate, params, SamplingDefaults(),
                                                    lambda _: None, lambda: False, TaskId("bench"))
            speeds[path].append(result.completion_tokens / (time.perf_counter() - start))
    await loop.run_in_executor(model_thread, engine.release_followers)
    return {path: statistics.median(values) for path, values in speeds.items()}


def rank_main(args: argparse.Namespace) -> None:
    engine = Engine()
    if args.sharding == "none":
        engine.load(args.model)
    else:
        engine.load(args.model, RankSetup(rank=args.rank, ring_hosts=json.loads(args.hosts), sharding=args.sharding,
                                          start_layer=args.start, end_layer=args.end))
    if args.rank == 0:
        print(json.dumps(asyncio.run(measure(engine, args.max_tokens, args.repeat))), flush=True)
    else:
        follow(engine)
    os._exit(0)  # as a runner leaves its group: MLX's ring threads are not torn down by the interpreter


def run_setup(model: Path, sharding: str, layers: int, args: argparse.Namespace) -> dict[str, float]:
    port = free_port()
    hosts = json.dumps([f"127.0.0.1:{port}", f"127.0.0.1:{port + 1}"])
    ranks = [0] if sharding == "none" else [0, 1]
    blocks = [(0, layers // 2), (layers // 2, layers)]
    processes = [
        subprocess.Popen([sys.executable, "-m", "bench.lockstep_batch", "--rank", str(rank), "--hosts", hosts,
                          "--model", str(model), "--sharding", sharding, "--start", str(blocks[rank][0]),
                          "--end", str(blocks[rank][1]), "--max-tokens", str(args.max_tokens), "--repeat", str(args.repeat)],
                         stdout=subprocess.PIPE, text=True)
        for rank in ranks
    ]
    out = [p.communicate(timeout=1200)[0] for p in processes]
    speeds: dict[str, float] = json.loads(out[0].splitlines()[-1])  # what rank 0 printed: measure()'s result
    return speeds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=3)
    for internal in ("--rank", "--start", "--end"):
        parser.add_argument(internal, type=int, default=-1, help=argparse.SUPPRESS)
    for internal in ("--hosts", "--model", "--sharding"):
        parser.add_argument(internal, default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank >= 0:
        rank_main(args)
        return
    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_model(Path(tmp) / "model", Dims(hidden=args.hidden, intermediate=args.hidden * 2,
                                                          layers=args.layers, heads=8, kv_heads=4))
        print(f"model: hidden {args.hidden}, {args.layers} layers; one greedy request of {args.max_tokens} tokens, "
              f"median of {args.repeat}")
        print("| setup | batch (lockstep) tok/s | single path tok/s | batch / single |")
        print("|---|---|---|---|")
        for name, sharding in [("1 process", "none"), ("2 ranks tensor", "tensor"), ("2 ranks pipeline", "pipeline")]:
            speeds = run_setup(model, sharding, args.layers, args)
            print(f"| {name} | {speeds['batch']:.1f} | {speeds['single']:.1f} | {speeds['batch'] / speeds['single']:.2f}x |",
                  flush=True)


if __name__ == "__main__":
    main()
