"""Rerank throughput against embeddings, through one exo node: documents per second for N documents.

(a) POST /v1/rerank of N documents against one query on a cross-encoder, (b) POST /v1/embeddings of the
same N documents on a bi-encoder of the same size, one request each, its JSON answer parsed. Both models
are random-weight BERTs of MiniLM's size (hidden 384, 6 layers, 12 heads, intermediate 1536: as
cross-encoder/ms-marco-MiniLM-L6-v2 and all-MiniLM-L6-v2) with the tiny test tokenizer, served by one
exo process (embedded NATS, the models from a local imitation of the Hub). Documents are 3-8 words each,
the query 4 words, the same texts for both in a run. A rerank runs each (query, document) pair through the
encoder, so its sequences are the query's tokens longer than the embedding's; the table says both.
Runs alternate the two (and which goes first).

    uv run python -m bench.rerank [--runs 5] [--documents 1,32,128] [--hidden 384] [--layers 6]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from bench.embeddings import spread, texts
from bench.summary import alternating
from tests.support.cross_encoder_model import make_tiny_cross_encoder
from tests.support.embedding_models import make_tiny_bert
from tests.support.exo_process import ExoProcess
from tests.support.fake_hub import FakeHub

RERANKER, EMBEDDER = "exo-bench/minilm-sized-random-cross-encoder", "exo-bench/minilm-sized-random-bert"
SYSTEMS = ["rerank", "embed"]
QUERY = "what is the capital"


def request(http: httpx.Client, system: str, documents: list[str]) -> int:
    """One request; the tokens it used (usage.total_tokens)."""
    if system == "rerank":
        answer = http.post("/v1/rerank", json={"model": RERANKER, "query": QUERY, "documents": documents,
                                               "return_documents": False})
    else:
        answer = http.post("/v1/embeddings", json={"model": EMBEDDER, "input": documents})
    answer.raise_for_status()
    body = answer.json()
    assert len(body["results" if system == "rerank" else "data"]) == len(documents)
    return int(body["usage"]["total_tokens"])


def measure(args: argparse.Namespace, url: str) -> tuple[dict[int, dict[str, list[float]]], dict[int, dict[str, int]]]:
    """Per N, per system, the seconds of each run, and the tokens of one request."""
    seconds: dict[int, dict[str, list[float]]] = {n: {s: [] for s in SYSTEMS} for n in args.documents}
    tokens: dict[int, dict[str, int]] = {n: {} for n in args.documents}
    with httpx.Client(base_url=url, timeout=900) as http:
        for n in args.documents:  # warm both paths at every size
            for system in SYSTEMS:
                tokens[n][system] = request(http, system, texts(n, -1))
        for n in args.documents:
            for run, system in alternating(SYSTEMS, args.runs):
                start = time.perf_counter()
                request(http, system, texts(n, run))
                seconds[n][system].append(time.perf_counter() - start)
    return seconds, tokens


def report(args: argparse.Namespace, seconds: dict[int, dict[str, list[float]]], tokens: dict[int, dict[str, int]]) -> None:
    print(f"models: random BERTs, hidden {args.hidden}, {args.layers} layers, {args.hidden // 32} heads, intermediate "
          f"{args.hidden * 4}; documents of 3-8 words, query {QUERY!r}; {args.runs} runs each, alternating")
    print("| documents | rerank docs/s | embed docs/s | ratio (rerank / embed) | rerank tokens | embed tokens "
          "| rerank ms | embed ms |")
    print("|---|---|---|---|---|---|---|---|")
    for n, by_system in seconds.items():
        rates = {s: [n / t for t in by_system[s]] for s in SYSTEMS}
        ms = {s: statistics.median(by_system[s]) * 1000 for s in SYSTEMS}
        ratio = statistics.median(rates["rerank"]) / statistics.median(rates["embed"])
        print(f"| {n} | {spread(rates['rerank'])} | {spread(rates['embed'])} | {ratio:.2f} | {tokens[n]['rerank']} | "
              f"{tokens[n]['embed']} | {ms['rerank']:.1f} | {ms['embed']:.1f} |")


def serve(root: Path, args: argparse.Namespace) -> tuple[FakeHub, ExoProcess]:
    sizes = {"hidden": args.hidden, "layers": args.layers, "heads": args.hidden // 32, "intermediate": args.hidden * 4,
             "max_position": 512}
    models = {RERANKER: make_tiny_cross_encoder(root / "reranker", **sizes),
              EMBEDDER: make_tiny_bert(root / "embedder", **sizes)}
    hub = FakeHub(models)
    env = {"HF_ENDPOINT": hub.start(), "HF_HOME": str(root / "hf"), "HF_HUB_DISABLE_TELEMETRY": "1",
           "EXO_LOG_LEVEL": "WARNING"}
    exo = ExoProcess(root / "data", env).start()
    with httpx.Client(base_url=exo.url, timeout=300) as http:
        for model_id in models:
            http.post("/models/add", json={"model_id": model_id}).raise_for_status()
            http.post("/place_instance", json={"model_id": model_id, "wait": 300}).raise_for_status()
    return hub, exo


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--documents", type=lambda s: [int(n) for n in s.split(",")], default=[1, 32, 128])
    parser.add_argument("--hidden", type=int, default=384, help="a multiple of 32 (heads of 32 dimensions, as MiniLM's)")
    parser.add_argument("--layers", type=int, default=6)
    args = parser.parse_args()
    if args.hidden % 32:
        parser.error("--hidden must be a multiple of 32")
    with tempfile.TemporaryDirectory() as tmp:
        hub, exo = serve(Path(tmp), args)
        try:
            seconds, tokens = measure(args, exo.url)
        finally:
            exo.interrupt()
            hub.stop()
    report(args, seconds, tokens)


if __name__ == "__main__":
    main()
