"""A prefilled request's KV cache sent to another process over loopback TCP (exo/runner/kv_transfer.py):
bytes and time per prompt length and cache type, beside the prefill that made it.

The prefill side is this process: it prefills each prompt once per cache type (mlx-lm's own
generate_step, as prefill_for_transfer runs it), then sends the cache --runs times to a receiver in
a process of its own (tests/support/kv_peer.py), which rebuilds mlx-lm's cache objects and answers.
A transfer's time runs from before encoding (the sender copies its cache's tokens out of mlx-lm's
spare room) to the receiver's answer, so both ends' copies count. Cache types: fp32 (the model as
generated), fp16 (the model cast to float16, so its cache is too), kv8 and kv4 (fp32 model, cache
quantized by mlx-lm from the first token, in groups of 32: the head dim).

    uv run python -m bench.kv_transfer [--lengths 10 1000 8000] [--runs 7] [--prefill-runs 3]
        [--hidden 128 --layers 4 --heads 4 --kv-heads 2]

A split pays when transfer << prefill: docs/multinode.md puts these numbers beside real models'.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm import load

from exo.core.ids import ModelId, TaskId
from exo.runner import kv_transfer
from tests.support.tiny_model import Dims, make_tiny_model

ROOT = Path(__file__).resolve().parent.parent
MODEL = ModelId("bench/kv")
KINDS = {"fp32": (mx.float32, 0), "fp16": (mx.float16, 0), "kv8": (mx.float32, 8), "kv4": (mx.float32, 4)}
GROUP = 32


def prompt(tokenizer: Any, length: int) -> list[int]:
    text = " ".join(f"Day {n}: the fisherman went out on the sea at {n % 12} o'clock and came home with "
                    f"{n * 7 % 13} fish, bread and news of the river." for n in range(length // 50 + 2))
    tokens: list[int] = tokenizer.encode(text)[:length]
    return tokens


def spread(values: list[float], digits: int = 1) -> str:
    """median [min-max] (n)"""
    return f"{statistics.median(values):.{digits}f} [{min(values):.{digits}f}-{max(values):.{digits}f}] ({len(values)})"


async def transfer_once(port: int, model_dir: Path, kv_bits: int, cache: list[Any], pending: list[int]) -> tuple[float, int]:
    """(seconds from encoding to the receiver's answer, bytes on the wire)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    settings = {"model_dir": str(model_dir), "model_id": MODEL, "max_tokens": 0, "kv_bits": kv_bits,
                "kv_group_size": GROUP if kv_bits else 0}
    writer.write(json.dumps(settings).encode() + b"\n")
    await writer.drain()
    start = time.perf_counter()
    sent = await kv_transfer.send_cache(writer, kv_transfer.encode_cache(TaskId("bench"), MODEL, pending, cache))
    answer = json.loads(await reader.readline())
    elapsed = time.perf_counter() - start
    writer.close()
    if "classes" not in answer:
        raise RuntimeError(f"the receiver did not take the cache: {answer}")
    return elapsed, sent


def measure(args: argparse.Namespace, port: int, model_dir: Path, model: Any, tokens: list[int],
            kv_bits: int) -> dict[str, Any]:
    prefill_s: list[float] = []
    for _ in range(args.prefill_runs if len(tokens) < 4000 else max(1, args.prefill_runs - 2)):
        start = time.perf_counter()
        cache, pending = kv_transfer.prefill_for_transfer(model, tokens, kv_bits=kv_bits, kv_group_size=GROUP)
        prefill_s.append(time.perf_counter() - start)
    runs = [asyncio.run(transfer_once(port, model_dir, kv_bits, cache, pending)) for _ in range(args.runs)]
    return {"bytes": runs[0][1], "transfer_ms": [s * 1000 for s, _ in runs], "prefill_ms": [s * 1000 for s in prefill_s]}


def report(length: int, kind: str, result: dict[str, Any]) -> None:
    transfer, prefill = statistics.median(result["transfer_ms"]), statistics.median(result["prefill_ms"])
    rate = result["bytes"] / (transfer / 1000) / 1e9
    print(f"{length:>6}  {kind:>4}  {result['bytes'] / 1e6:>9.3f}  {spread(result['transfer_ms'], 2):>26}  {rate:>6.2f}  "
          f"{spread(result['prefill_ms'], 0):>26}  {100 * transfer / prefill:>7.2f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[10, 1000, 8000])
    parser.add_argument("--kinds", nargs="+", default=list(KINDS), choices=list(KINDS))
    parser.add_argument("--runs", type=int, default=7, help="transfers per prompt and cache type")
    parser.add_argument("--prefill-runs", type=int, default=3, help="prefills per prompt and cache type (8k: 2 fewer)")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    args = parser.parse_args()
    dims = Dims(hidden=args.hidden, intermediate=args.hidden * 2, layers=args.layers, heads=args.heads,
                kv_heads=args.kv_heads)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_tiny_model(Path(tmp) / "model", dims)
        peer = subprocess.Popen([sys.executable, "-m", "tests.support.kv_peer"], cwd=ROOT, stdout=subprocess.PIPE, text=True)
        try:
            assert peer.stdout is not None
            port = int(peer.stdout.readline())
            run(args, dims, port, model_dir)
        finally:
            peer.kill()
            peer.wait()


def run(args: argparse.Namespace, dims: Dims, port: int, model_dir: Path) -> None:
    print(f"random llama: hidden {dims.hidden}, {dims.layers} layers, {dims.kv_heads} kv heads of {dims.head_dim}; "
          f"loopback TCP to another process; transfer: encode + send + rebuild, median [range] (samples)")
    print(f"{'tokens':>6}  {'kind':>4}  {'MB':>9}  {'transfer ms':>26}  {'GB/s':>6}  {'prefill ms':>26}  {'xfer/pre%':>7}")
    for kind in args.kinds:
        dtype, kv_bits = KINDS[kind]
        model, tokenizer = load(str(model_dir))  # afresh: fp16 weights cast back would not be the fp32 model
        model.set_dtype(dtype)
        # Uncounted: the receiver loads the model on its first transfer, and mlx compiles kernels on first use.
        measure(argparse.Namespace(runs=1, prefill_runs=1), port, model_dir, model, prompt(tokenizer, 600), kv_bits)
        for length in args.lengths:
            report(length, kind, measure(args, port, model_dir, model, prompt(tokenizer, length), kv_bits))


if __name__ == "__main__":
    main()
