"""The API node's cost of encoding one streamed chat chunk (exo/api/sse.py): msgspec's encoder,
which SseStream uses, against the stdlib's json.dumps, which it used before (~6% of the API
node's py-spy samples under bench/scale.py at 1,000 nodes, 2026-12-05). Both encode the same
chunk; the bytes parse to the same JSON (checked). Prints microseconds per chunk, median
[min-max] over the runs, the two alternating.

    uv run python -m bench.sse_encoding [--runs 7] [--calls 20000]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import msgspec

CHUNK = {"id": "chatcmpl-0c5e1f2a3b4c5d6e7f8091a2b3c4d5e6", "object": "chat.completion.chunk", "created": 1764900000,
         "model": "mlx-community/Qwen3-0.6B-4bit", "system_fingerprint": None,
         "choices": [{"index": 0, "delta": {"content": " hello wörld"}, "logprobs": None, "finish_reason": None}]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--calls", type=int, default=20_000)
    args = parser.parse_args()
    encoder = msgspec.json.Encoder()
    ways = {"json.dumps": lambda: json.dumps(CHUNK, ensure_ascii=False).encode(), "msgspec": lambda: encoder.encode(CHUNK)}
    assert json.loads(ways["json.dumps"]()) == json.loads(ways["msgspec"]())
    times: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(args.runs):
        for name, encode in ways.items():
            started = time.perf_counter()
            for _ in range(args.calls):
                encode()
            times[name].append((time.perf_counter() - started) / args.calls * 1e6)
    for name, runs in times.items():
        print(f"{name}: {statistics.median(runs):.2f} us [{min(runs):.2f}-{max(runs):.2f}] per chunk "
              f"(n = {args.runs} runs of {args.calls})")
    print(f"ratio: {statistics.median(times['json.dumps']) / statistics.median(times['msgspec']):.1f}x")


if __name__ == "__main__":
    main()
