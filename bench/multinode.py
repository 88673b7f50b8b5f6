"""One model on 1 node vs 2 nodes (tensor and pipeline), in one run: decode tokens/s and time to
first token of single requests, and requests/s at several concurrencies next to mlx_lm.server.

Everything runs on this machine: a nats-server, a head node (master + API) and two worker
processes; the two ranks of a 2-node instance talk over loopback TCP (MLX ring backend). On one
machine, two nodes share its cores: this measures exo's overhead for splitting a model, not the
speed-up of more hardware.

    uv run python -m bench.multinode [--hidden 512] [--layers 8] [--max-tokens 128] [--concurrency 1 4 8]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import TypedDict

import httpx

from bench.api_load import LoadResult, load, start_mlx_lm_server
from tests.support.cluster import NatsServer, start_node, state_of, wait_until
from tests.support.exo_process import ExoProcess, free_port
from tests.support.tiny_model import Dims, make_tiny_model

MODEL = "local/bench"
PROMPT = [{"role": "user", "content": "Write a short story about a lighthouse keeper and the sea."}]
SETUPS = [("1 node", "pipeline", 1), ("2 nodes tensor", "tensor", 2), ("2 nodes pipeline", "pipeline", 2)]


class SetupResult(TypedDict):
    """One setup: single requests' median TTFT (ms) and decode tokens/s, and the load at each concurrency."""

    ttft: float
    tps: float
    loads: dict[int, LoadResult]


def single_request(url: str, max_tokens: int) -> tuple[float, float]:
    """(time to first token in ms, decode tokens/s after the first token) of one streamed greedy chat."""
    body = {"model": MODEL, "messages": PROMPT, "temperature": 0, "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    first: float | None = None
    tokens: int | None = None
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=600) as response:
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if first is None and chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                first = time.perf_counter()
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    end = time.perf_counter()
    assert first is not None and tokens, "no text came back"
    return (first - start) * 1000, (tokens - 1) / (end - first)


def start_cluster(root: Path) -> tuple[NatsServer, ExoProcess, list[ExoProcess]]:
    nats = NatsServer(root / "nats")
    env = {"EXO_ADVERTISE_ADDRESSES": "127.0.0.1", "EXO_LOG_LEVEL": "WARNING"}
    head = start_node(root, "head", nats.url, "--no-worker", env=env)
    workers: list[ExoProcess] = []
    for n in (1, 2):
        first = free_port()
        workers.append(start_node(root, f"worker{n}", nats.url, "--no-master", "--no-api",
                                  env=env | {"EXO_RING_PORTS": f"{first}-{first + 20}"}))
    wait_until(lambda: len(state_of(head).nodes) == 2, 60, what="two workers")
    return nats, head, workers


def measure(url: str, sharding: str, nodes: int, args: argparse.Namespace) -> SetupResult:
    with httpx.Client(base_url=url, timeout=600) as http:
        placed = http.post("/place_instance", json={"model_id": MODEL, "sharding": sharding, "min_nodes": nodes,
                                                    "max_queue": 1000, "wait": 600})
        assert placed.status_code == 200, placed.text
        single_request(url, 8)  # warm
        runs = [single_request(url, args.max_tokens) for _ in range(args.repeat)]
        result = SetupResult(ttft=statistics.median(r[0] for r in runs), tps=statistics.median(r[1] for r in runs), loads={})
        for concurrency in args.concurrency:
            result["loads"][concurrency] = asyncio.run(load(url, MODEL, concurrency, 2, args.max_tokens // 2))
        http.delete(f"/instance/{placed.json()['instance_id']}")
        wait_until(lambda: not http.get("/state").json()["runners"], 60, what="runners gone")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8])
    args = parser.parse_args()
    dims = Dims(hidden=args.hidden, intermediate=args.hidden * 2, layers=args.layers, heads=8, kv_heads=4)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model_dir = make_tiny_model(root / "model", dims)
        nats, head, workers = start_cluster(root)
        results: dict[str, SetupResult] = {}
        try:
            httpx.post(f"{head.url}/models/add", json={"model_id": MODEL, "path": str(model_dir)}).raise_for_status()
            for name, sharding, nodes in SETUPS:
                results[name] = measure(head.url, sharding, nodes, args)
            server, server_url = start_mlx_lm_server(model_dir, root / "mlx_lm_server.log")
            try:
                reference = {c: asyncio.run(load(server_url, str(model_dir), c, 2, args.max_tokens // 2))
                             for c in args.concurrency}
            finally:
                server.terminate()
        finally:
            for node in [*workers, head]:
                node.interrupt()
            nats.stop()
    _print(args, dims, results, reference)


def _print(args: argparse.Namespace, dims: Dims, results: dict[str, SetupResult], reference: dict[int, LoadResult]) -> None:
    print(f"model: hidden {dims.hidden}, {dims.layers} layers, {dims.heads} heads / {dims.kv_heads} kv heads; "
          f"{args.max_tokens} tokens per single request (median of {args.repeat}), greedy, streamed")
    print("| setup | TTFT ms | decode tok/s | vs 1 node |")
    print("|---|---|---|---|")
    base = results["1 node"]["tps"]
    for name, row in results.items():
        print(f"| {name} | {row['ttft']:.1f} | {row['tps']:.1f} | {row['tps'] / base:.2f}x |")
    print()
    print(f"requests/s, {args.max_tokens // 2} tokens per request, 2 requests per client")
    print("| concurrency | " + " | ".join(results) + " | mlx_lm.server |")
    print("|---|" + "---|" * (len(results) + 1))
    for c in args.concurrency:
        cells = [f"{results[name]['loads'][c]['rps']:.2f}" for name in results]
        print(f"| {c} | " + " | ".join(cells) + f" | {reference[c]['rps']:.2f} |")


if __name__ == "__main__":
    main()
