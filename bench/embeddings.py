"""Embeddings per second through exo versus mlx-embeddings called directly, side by side in one run.

(a) mlx-embeddings in this process: `mlx_embeddings.load`, then per batch the tokenizer (padded on the
right), the model's forward with the attention mask, mean pooling and L2 normalization, what exo's
engine does (exo/runner/embedding_engine.py), evaluated and turned into a numpy array; loading is not
timed. (b) the same model directory through `exo`'s POST /v1/embeddings (a separate process with its
embedded NATS, the model from a local imitation of the Hub), one request per batch, the JSON answer
parsed into a numpy array. The model is a random-weight BERT of MiniLM's size (hidden 384, 6 layers,
12 heads, intermediate 1536) with the tiny test tokenizer; inputs are a few words each, varied, the same
texts for both systems in a run. Runs alternate the two systems (and which goes first). Target: the
cluster reaches at least 50% of direct throughput at batch 32 and 256.

    uv run python -m bench.embeddings [--runs 5] [--batches 1,32,256] [--hidden 384] [--layers 6]
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import mlx.core as mx
import mlx_embeddings
import numpy as np

from bench.api_load import start_exo
from bench.summary import alternating
from tests.support.embedding_models import make_tiny_bert

MODEL_ID = "exo-bench/minilm-sized-random-bert"
SYSTEMS = ["direct", "cluster"]
TARGET = 0.5  # cluster / direct throughput at batch 32 and above
WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "a", "fast", "leaps", "sleepy", "hello", "world",
         "embeddings", "are", "vectors", "and", "similar", "sentences", "get", "nearby", "what", "is", "capital", "of",
         "france", "paris", "turn", "text", "into", "numbers", "here", "too"]


def texts(count: int, seed: int) -> list[str]:
    """`count` inputs of 3 to 8 words each (5 to 10 tokens with [CLS] and [SEP]), varied by `seed`."""
    rng = random.Random(seed)
    return [" ".join(rng.choices(WORDS, k=rng.randint(3, 8))) for _ in range(count)]


def direct(model: Any, tokenizer: Any, batch: list[str]) -> np.ndarray:
    """`model`, `tokenizer`: what mlx_embeddings.load returns (an mlx module and a wrapper of transformers')."""
    encoded = tokenizer(batch, padding=True)  # BERT's tokenizer pads on the right
    mask = mx.array(encoded["attention_mask"], dtype=mx.float32)
    hidden = model(mx.array(encoded["input_ids"]), attention_mask=mask).last_hidden_state.astype(mx.float32)
    pooled = (hidden * mask[..., None]).sum(axis=1) / mx.maximum(mask.sum(axis=1, keepdims=True), 1e-9)
    vectors = pooled / mx.maximum(mx.linalg.norm(pooled, axis=-1, keepdims=True), 1e-12)
    mx.eval(vectors)
    return np.array(vectors)


def through_exo(http: httpx.Client, batch: list[str]) -> np.ndarray:
    answer = http.post("/v1/embeddings", json={"model": MODEL_ID, "input": batch})
    answer.raise_for_status()
    return np.array([row["embedding"] for row in answer.json()["data"]], dtype=np.float32)


def timed(system: str, model: Any, tokenizer: Any, http: httpx.Client, batch: list[str]) -> tuple[float, np.ndarray]:
    start = time.perf_counter()
    vectors = direct(model, tokenizer, batch) if system == "direct" else through_exo(http, batch)
    return time.perf_counter() - start, vectors


def measure(args: argparse.Namespace, model_dir: Path, url: str) -> tuple[dict[int, dict[str, list[float]]], float]:
    """Per batch size, per system, the seconds of each run; and the largest difference between the two
    systems' vectors for the same texts (compared in the warm-up, untimed)."""
    model, tokenizer = mlx_embeddings.load(str(model_dir))
    seconds: dict[int, dict[str, list[float]]] = {n: {s: [] for s in SYSTEMS} for n in args.batches}
    worst = 0.0
    with httpx.Client(base_url=url, timeout=600) as http:
        for n in args.batches:  # warm both paths at every size: kernels, connections, the runner
            ours, theirs = (timed(system, model, tokenizer, http, texts(n, -1))[1] for system in SYSTEMS)
            assert ours.shape == theirs.shape == (n, args.hidden), (ours.shape, theirs.shape)
            worst = max(worst, float(np.abs(ours - theirs).max()))
        for n in args.batches:
            for run, system in alternating(SYSTEMS, args.runs):
                seconds[n][system].append(timed(system, model, tokenizer, http, texts(n, run))[0])
    return seconds, worst


def spread(values: list[float]) -> str:
    """Median [min-max], with a decimal where the values are small (a CPU's MiniLM makes ~10 embeddings/s)."""
    d = 1 if max(values) < 100 else 0
    return f"{statistics.median(values):.{d}f} [{min(values):.{d}f}-{max(values):.{d}f}]"


def report(args: argparse.Namespace, seconds: dict[int, dict[str, list[float]]], worst: float) -> None:
    print(f"model: random BERT, hidden {args.hidden}, {args.layers} layers, {args.hidden // 32} heads, intermediate "
          f"{args.hidden * 4}; inputs of 3-8 words (5-10 tokens); {args.runs} runs per system and batch, alternating; "
          f"largest difference between the two systems' vectors {worst:.1e}")
    print("| batch | runs | direct emb/s | cluster emb/s | ratio (cluster / direct) | direct ms | cluster ms | added ms |")
    print("|---|---|---|---|---|---|---|---|")
    ratios: dict[int, float] = {}
    for n, by_system in seconds.items():
        rates = {s: [n / t for t in by_system[s]] for s in SYSTEMS}
        ms = {s: statistics.median(by_system[s]) * 1000 for s in SYSTEMS}
        ratios[n] = statistics.median(rates["cluster"]) / statistics.median(rates["direct"])
        print(f"| {n} | {args.runs} | {spread(rates['direct'])} | {spread(rates['cluster'])} | "
              f"{ratios[n]:.2f} | {ms['direct']:.1f} | {ms['cluster']:.1f} | {ms['cluster'] - ms['direct']:+.1f} |")
    judged = {n: r for n, r in ratios.items() if n >= 32}
    if not judged:
        print("target (cluster >= 50% of direct at batch 32 and 256): not judged, no batch of 32 or more measured")
        return
    verdict = "met" if all(r >= TARGET for r in judged.values()) else "MISSED"
    print(f"target (cluster >= {TARGET:.0%} of direct at batch 32 and 256): {verdict} ("
          + ", ".join(f"batch {n}: {r:.0%}" for n, r in judged.items()) + ")")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--batches", type=lambda s: [int(n) for n in s.split(",")], default=[1, 32, 256])
    parser.add_argument("--hidden", type=int, default=384, help="a multiple of 32 (heads of 32 dimensions, as MiniLM's)")
    parser.add_argument("--layers", type=int, default=6)
    args = parser.parse_args()
    if args.hidden % 32:
        parser.error("--hidden must be a multiple of 32")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model_dir = make_tiny_bert(root / "model", hidden=args.hidden, layers=args.layers, heads=args.hidden // 32,
                                   intermediate=args.hidden * 4, max_position=512)
        hub, exo = start_exo(model_dir, root, model_id=MODEL_ID)
        try:
            seconds, worst = measure(args, model_dir, exo.url)
        finally:
            exo.interrupt()
            hub.stop()
    report(args, seconds, worst)


if __name__ == "__main__":
    main()
