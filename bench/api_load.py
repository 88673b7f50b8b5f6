"""The API under load: requests/s and time to first token at several concurrencies, exo's
OpenAI API side by side with mlx_lm.server on the same model, in the same run.

Each client loops: a streamed, greedy chat completion of --max-tokens tokens, then the next;
requests/s is completed requests over wall time; TTFT is from sending to the first content.

    uv run python -m bench.api_load [--concurrency 1 8 32] [--requests-per-client 4] [--max-tokens 64] [--max-batch N]

--max-batch sets EXO_MAX_BATCH for exo's runner (how many requests decode together; 1: one at a time).
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

from tests.support.exo_process import ExoProcess
from tests.support.fake_hub import FakeHub
from tests.support.mlx_lm_server import start_mlx_lm_server as start_mlx_lm_server  # the benches' reference
from tests.support.tiny_model import TINY_MODEL_ID, make_tiny_model

MESSAGES = [{"role": "user", "content": "Write a short story about a lighthouse keeper and the sea."}]


class LoadResult(TypedDict):
    """One concurrency level on one server: requests/s, TTFT p50 and p99 in ms, requests sent, failed."""

    rps: float
    p50: float
    p99: float
    n: int
    failed: int


async def one_request(client: httpx.AsyncClient, model: str, max_tokens: int) -> float | None:
    """Returns the time to first token of one streamed request, or None if the server failed it."""
    try:
        return await _timed_request(client, model, max_tokens)
    except httpx.HTTPError:  # a refused or reset connection counts as a failed request
        return None


async def _timed_request(client: httpx.AsyncClient, model: str, max_tokens: int) -> float:
    body = {"model": model, "messages": MESSAGES, "temperature": 0, "max_tokens": max_tokens, "stream": True}
    start = time.perf_counter()
    first = None
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if first is None and line.startswith("data: {"):
                choices = json.loads(line[6:]).get("choices") or [{}]
                if choices[0].get("delta", {}).get("content"):
                    first = time.perf_counter() - start
    assert first is not None, "no text came back"
    return first


async def load(url: str, model: str, concurrency: int, per_client: int, max_tokens: int) -> LoadResult:
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        await _timed_request(client, model, max_tokens)  # warm: kernels, connections

        async def client_loop() -> list[float | None]:
            return [await one_request(client, model, max_tokens) for _ in range(per_client)]

        start = time.perf_counter()
        results = [t for loop in await asyncio.gather(*(client_loop() for _ in range(concurrency))) for t in loop]
        wall = time.perf_counter() - start
    ttfts = sorted(t for t in results if t is not None)
    if not ttfts:
        return {"rps": 0.0, "p50": float("nan"), "p99": float("nan"), "n": len(results), "failed": len(results)}
    return {"rps": len(ttfts) / wall, "p50": statistics.median(ttfts) * 1000, "n": len(results),
            "p99": ttfts[min(len(ttfts) - 1, round(0.99 * (len(ttfts) - 1)))] * 1000, "failed": len(results) - len(ttfts)}


def start_exo(model_dir: Path, root: Path, max_batch: int | None = None,
              extra_env: dict[str, str] | None = None, model_id: str = TINY_MODEL_ID) -> tuple[FakeHub, ExoProcess]:
    hub = FakeHub({model_id: model_dir})
    endpoint = hub.start()
    env = {"HF_ENDPOINT": endpoint, "HF_HOME": str(root / "hf"), "HF_HUB_DISABLE_TELEMETRY": "1",
           "EXO_LOG_LEVEL": "WARNING", **(extra_env or {})}
    if max_batch is not None:
        env["EXO_MAX_BATCH"] = str(max_batch)
    exo = ExoProcess(root / "data", env).start()
    with httpx.Client(base_url=exo.url, timeout=300) as http:
        http.post("/models/add", json={"model_id": model_id}).raise_for_status()
        http.post("/place_instance", json={"model_id": model_id, "max_queue": 1000}).raise_for_status()
    return hub, exo


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--requests-per-client", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-batch", type=int, default=None, help="EXO_MAX_BATCH for exo (default: exo's own)")
    args = parser.parse_args()
    rows: list[tuple[int, LoadResult, LoadResult]] = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model_dir = make_tiny_model(root / "model")
        hub, exo = start_exo(model_dir, root, args.max_batch)
        server, server_url = start_mlx_lm_server(model_dir, root / "mlx_lm_server.log")
        try:
            for concurrency in args.concurrency:  # alternate the two servers at each level
                per = max(1, args.requests_per_client)
                ours = asyncio.run(load(exo.url, TINY_MODEL_ID, concurrency, per, args.max_tokens))
                theirs = asyncio.run(load(server_url, str(model_dir), concurrency, per, args.max_tokens))
                rows.append((concurrency, ours, theirs))
        finally:
            server.terminate()
            server.wait(10)
            exo.interrupt()
            hub.stop()
    batch = f"EXO_MAX_BATCH={args.max_batch}" if args.max_batch is not None else "exo's default batch limit"
    print(f"tiny model (hidden 64, 2 layers), {args.max_tokens} tokens per request, greedy, streamed, {batch}")
    print("| concurrency | requests | exo req/s | mlx_lm.server req/s | exo TTFT p50 / p99 | "
          "mlx_lm.server TTFT p50 / p99 | failed (exo / mlx_lm.server) |")
    print("|---|---|---|---|---|---|---|")
    for concurrency, ours, theirs in rows:
        print(f"| {concurrency} | {ours['n']} | {ours['rps']:.1f} | {theirs['rps']:.1f} | "
              f"{ours['p50']:.1f} / {ours['p99']:.1f} ms | {theirs['p50']:.1f} / {theirs['p99']:.1f} ms | "
              f"{ours['failed']} / {theirs['failed']} |")


if __name__ == "__main__":
    main()
