"""What exo adds on top of mlx-lm: time to first token and decode speed, side by side, one run.

(a) mlx-lm's stream_generate in this process; (b) the same model and prompt through `exo`'s
OpenAI API (a separate process with its embedded NATS, the model downloaded from a local
imitation of the Hub). Greedy, same max tokens; runs alternate so drift hits both alike.

    uv run python -m bench.overhead [--requests 20] [--max-tokens 64] [--hidden 256 --layers 4]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import mlx_lm

from tests.support.exo_process import ExoProcess
from tests.support.fake_hub import FakeHub
from tests.support.tiny_model import TINY_MODEL_ID, Dims, make_tiny_model

MESSAGES = [{"role": "user", "content": "Write a short story about a lighthouse keeper and the sea."}]
Run = tuple[float, float, int]  # (time to first token s, decode tokens/s, completion tokens) of one request


def direct_run(model: Any, tokenizer: Any, prompt: str, max_tokens: int) -> Run:
    """`model`, `tokenizer`: what mlx_lm.load returns (mypy does not follow mlx_lm: see pyproject.toml)."""
    start = time.perf_counter()
    stamps = [time.perf_counter() for _ in mlx_lm.stream_generate(model, tokenizer, prompt, max_tokens=max_tokens)]
    return stamps[0] - start, decode_rate(stamps), len(stamps)


def cluster_run(http: httpx.Client, max_tokens: int) -> Run:
    body = {"model": TINY_MODEL_ID, "messages": MESSAGES, "temperature": 0, "max_tokens": max_tokens,
            "stream": True, "stream_options": {"include_usage": True}}
    return timed_chat_stream(http, json.dumps(body).encode())


def timed_chat_stream(http: httpx.Client, body: bytes) -> Run:
    """(time to first token, decode tokens/s, completion tokens) of one streamed chat whose JSON
    body is ready to send."""
    start = time.perf_counter()
    stamps: list[float] = []
    tokens = 0
    with http.stream("POST", "/v1/chat/completions", content=body, headers={"Content-Type": "application/json"}) as response:
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            elif chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                stamps.append(time.perf_counter())
    # A chunk may carry several tokens (exo coalesces fast streams), so count tokens from usage.
    return stamps[0] - start, decode_rate(stamps, tokens), tokens


def decode_rate(stamps: list[float], tokens: int | None = None) -> float:
    """Tokens after the first, per second from the first token to the last."""
    return ((tokens or len(stamps)) - 1) / (stamps[-1] - stamps[0])


def start_cluster(model_dir: Path, root: Path) -> tuple[FakeHub, ExoProcess]:
    hub = FakeHub({TINY_MODEL_ID: model_dir})
    endpoint = hub.start()
    env = {"HF_ENDPOINT": endpoint, "HF_HOME": str(root / "hf"), "HF_HUB_DISABLE_TELEMETRY": "1",
           "EXO_LOG_LEVEL": "WARNING"}
    exo = ExoProcess(root / "data", env).start()
    with httpx.Client(base_url=exo.url, timeout=300) as http:
        http.post("/models/add", json={"model_id": TINY_MODEL_ID}).raise_for_status()
        http.post("/place_instance", json={"model_id": TINY_MODEL_ID}).raise_for_status()
    return hub, exo


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()
    dims = Dims(hidden=args.hidden, intermediate=args.hidden * 3, layers=args.layers, heads=8, kv_heads=4)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model_dir = make_tiny_model(root / "model", dims)
        hub, exo = start_cluster(model_dir, root)
        try:
            model, tokenizer = mlx_lm.load(str(model_dir))
            prompt = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
            with httpx.Client(base_url=exo.url, timeout=300) as http:
                for _ in range(3):  # warm both paths: kernels, connections, the runner's caches
                    direct_run(model, tokenizer, prompt, args.max_tokens)
                    cluster_run(http, args.max_tokens)
                direct: list[Run] = []
                cluster: list[Run] = []
                for _ in range(args.requests):
                    direct.append(direct_run(model, tokenizer, prompt, args.max_tokens))
                    cluster.append(cluster_run(http, args.max_tokens))
        finally:
            exo.interrupt()
            hub.stop()
    report(args, dims, direct, cluster)


def report(args: argparse.Namespace, dims: Dims, direct: list[Run], cluster: list[Run]) -> None:
    def p50(rows: list[Run], column: int) -> float:
        return statistics.median(r[column] for r in rows)

    ttft_direct, ttft_cluster = p50(direct, 0) * 1000, p50(cluster, 0) * 1000
    tps_direct, tps_cluster = p50(direct, 1), p50(cluster, 1)
    print(f"model: llama hidden={dims.hidden} layers={dims.layers}, {args.requests} requests, "
          f"{args.max_tokens} tokens each, greedy")
    print(f"{'':26}{'mlx-lm direct':>15}{'through exo':>15}{'exo - direct':>15}{'ratio':>8}")
    print(f"{'time to first token p50':26}{ttft_direct:>12.2f} ms{ttft_cluster:>12.2f} ms"
          f"{ttft_cluster - ttft_direct:>12.2f} ms{ttft_cluster / ttft_direct:>8.3f}")
    print(f"{'decode tokens/s p50':26}{tps_direct:>15.1f}{tps_cluster:>15.1f}"
          f"{tps_cluster - tps_direct:>15.1f}{tps_cluster / tps_direct:>8.3f}")
    tokens = {r[2] for r in cluster}
    print(f"completion tokens per cluster request: {sorted(tokens)}")


if __name__ == "__main__":
    main()
