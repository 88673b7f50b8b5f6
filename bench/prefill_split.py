"""Prefill on one instance and decode on another, against one instance doing both, through one exo
node on this machine (docs/multinode.md, "Prefill and decode on different instances").

One generated model, added twice: as `local/tiny` with one instance (role "both") and as
`local/split` with a prefill instance and a decode instance. Each prompt length is asked of both,
alternating, --runs times (a new prompt each time, so no prompt cache helps either). Reported per
length: TTFT and decode tokens/s (median [min-max] (n)) of each, their ratio, and the KV cache
bytes that crossed between the runners. Every split answer must equal the single instance's
(greedy): the bench stops otherwise.

All runners share this machine's two cores, so the split cannot gain here (no machine prefills
faster than another): what it measures is what the split costs, the transfer and the extra hop.

    uv run python -m bench.prefill_split [--lengths 1000 4000 8000] [--runs 3] [--max-tokens 64]
        [--hidden 128 --layers 4]
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
from mlx_lm import load

from bench.api_load import start_exo
from tests.support.tiny_model import TINY_MODEL_ID, Dims, make_tiny_model

SPLIT_ID = "local/split"


def spread(values: list[float], digits: int = 3) -> str:
    return f"{statistics.median(values):.{digits}f} [{min(values):.{digits}f}-{max(values):.{digits}f}] ({len(values)})"


def place_split(http: httpx.Client, model_dir: Path) -> None:
    http.post("/models/add", json={"model_id": SPLIT_ID, "path": str(model_dir)}).raise_for_status()
    for role in ("prefill", "decode"):
        http.post("/place_instance", json={"model_id": SPLIT_ID, "role": role, "max_queue": 1000,
                                           "wait": 300}).raise_for_status()
    deadline = time.monotonic() + 300
    while sum(r["status"] == "ready" for r in http.get("/state").json()["runners"].values()) < 3:
        assert time.monotonic() < deadline, "the three instances did not become ready"
        time.sleep(0.5)


def prompt_words(tokenizer: Any, tokens: int, salt: int) -> str:
    words = [f"item{salt}x{k % 89}" for k in range(tokens)]
    per_word = len(tokenizer.encode(" ".join(words[:100]))) / 100
    return " ".join(words[: max(1, int(tokens / per_word))])


def streamed(http: httpx.Client, model: str, content: str, max_tokens: int) -> tuple[float, float, str, dict[str, Any]]:
    """(TTFT s, decode tokens/s after the first, text, usage)."""
    body = {"model": model, "messages": [{"role": "user", "content": content}], "temperature": 0,
            "max_tokens": max_tokens, "stream": True, "stream_options": {"include_usage": True}}
    start, first, text = time.perf_counter(), 0.0, []
    usage: dict[str, Any] = {}
    with http.stream("POST", "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                usage = event.get("usage") or usage
                if delta := (event.get("choices") or [{}])[0].get("delta", {}).get("content"):
                    first = first or time.perf_counter() - start
                    text.append(delta)
    total = time.perf_counter() - start
    decode_rate = (usage["completion_tokens"] - 1) / (total - first) if total > first else 0.0
    return first, decode_rate, "".join(text), usage


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[1000, 4000, 8000])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()
    dims = Dims(hidden=args.hidden, intermediate=args.hidden * 2, layers=args.layers, heads=8, kv_heads=4)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model_dir = make_tiny_model(root / "model", dims)
        _, tokenizer = load(str(model_dir))
        # A long prompt's prefill on this CPU can outlast the default 120 s the decode side waits.
        hub, exo = start_exo(model_dir, root, extra_env={"EXO_LOG_LEVEL": "WARNING", "EXO_PREFILL_TIMEOUT_S": "1800"})
        try:
            with httpx.Client(base_url=exo.url, timeout=600) as http:
                place_split(http, model_dir)
                print(f"model: hidden {dims.hidden}, {dims.layers} layers, {dims.kv_heads} KV heads of {dims.head_dim} "
                      f"(float32); {args.max_tokens} tokens generated per request")
                print("| prompt tokens | TTFT alone (s) | TTFT split (s) | split/alone | decode tok/s alone | "
                      "decode tok/s split | KV sent (MB) |")
                print("|---|---|---|---|---|---|---|")
                for length in args.lengths:
                    measure(http, tokenizer, length, args, dims)
        finally:
            exo.interrupt()
            hub.stop()


def measure(http: httpx.Client, tokenizer: Any, length: int, args: argparse.Namespace, dims: Dims) -> None:
    ttft: dict[str, list[float]] = {"alone": [], "split": []}
    rate: dict[str, list[float]] = {"alone": [], "split": []}
    prompt_tokens = 0
    for run in range(args.runs):
        content = prompt_words(tokenizer, length, run * 100 + length)
        texts = {}
        for arm in (("alone", "split") if run % 2 == 0 else ("split", "alone")):
            first, decode_rate, text, usage = streamed(http, TINY_MODEL_ID if arm == "alone" else SPLIT_ID, content,
                                                       args.max_tokens)
            if arm == "split":
                assert usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"] - 1, usage
            ttft[arm].append(first)
            rate[arm].append(decode_rate)
            texts[arm], prompt_tokens = text, usage["prompt_tokens"]
        assert texts["alone"] == texts["split"], "the split's text is not the single instance's"
    kv_bytes = 2 * dims.layers * dims.kv_heads * dims.head_dim * 4 * (prompt_tokens - 1)
    ratio = statistics.median(ttft["split"]) / statistics.median(ttft["alone"])
    print(f"| {prompt_tokens} | {spread(ttft['alone'])} | {spread(ttft['split'])} | {ratio:.2f} | "
          f"{spread(rate['alone'], 1)} | {spread(rate['split'], 1)} | {kv_bytes / 1e6:.1f} |", flush=True)


if __name__ == "__main__":
    main()
