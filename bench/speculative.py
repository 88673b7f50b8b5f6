"""Speculative decoding: decode tokens/s with and without a draft model, side by side in one run,
(a) with mlx-lm's stream_generate in this process (draft_model= or not) and (b) through `exo`'s
OpenAI API (one node, a fake Hub serving the models; one instance placed with "draft_model", one
of the same model without). Greedy, the same prompts; the four systems alternate run by run.

The target is a random llama model (tests/support/tiny_model.py, float32); the draft is its 4-bit
copy made with mlx_lm.convert, which proposes many of the target's own choices. Acceptance is
accepted draft tokens / generated tokens: directly from `response.from_draft`, through exo from
`usage.completion_tokens_details.accepted_prediction_tokens`.

What to expect here: on a CPU-only machine a forward pass over k+1 tokens costs nearly k+1 times
one, and mlx's 4-bit matmuls are no faster than float32 on its CPU backend, so speculative decoding
is expected to be SLOWER here. The bench reports what it measures; a missed speed-up is reported
as missed, not as a failure. Where decode is bound by memory bandwidth (Apple silicon, CUDA) the
draft's k steps cost less than one target step, and the speed-up depends on the acceptance rate.

    uv run python -m bench.speculative [--runs 3] [--max-tokens 128] [--num-draft-tokens 3]
                                       [--hidden 512 --intermediate 1408 --layers 8]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, NamedTuple

import httpx
import mlx.core as mx
import mlx_lm
from mlx_lm.models.cache import make_prompt_cache

from tests.support.exo_process import ExoProcess
from tests.support.fake_hub import FakeHub
from tests.support.tiny_model import TINY_MODEL_ID, Dims, make_tiny_model

PLAIN_ID = "exo-test/tiny-llama-plain"  # the same model directory as TINY_MODEL_ID, placed without a draft
DRAFT_ID = "exo-test/tiny-llama-4bit"
ASKS = ["Write a short story about a lighthouse keeper and the sea.", "What is the capital of France?"]
SYSTEMS = ["direct plain", "direct draft", "exo plain", "exo draft"]


class Run(NamedTuple):
    """One request: decode tokens (after the first), their seconds, generated tokens, accepted draft tokens, text."""

    decode_tokens: int
    seconds: float
    tokens: int
    accepted: int
    text: str


def make_models(root: Path, dims: Dims) -> tuple[Path, Path]:
    target = make_tiny_model(root / "target", dims)
    draft = root / "draft"
    mlx_lm.convert(hf_path=str(target), mlx_path=str(draft), quantize=True, q_bits=4)
    (draft / "chat_template.jinja").unlink(missing_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        shutil.copy(target / name, draft / name)  # the target's tokenizer files, byte for byte
    return target, draft


def direct_run(model: Any, tokenizer: Any, prompt: str, max_tokens: int, draft: dict[str, Any]) -> Run:
    """`model`, `tokenizer`: what mlx_lm.load returns (mypy does not follow mlx_lm: see pyproject.toml)."""
    stamps: list[float] = []
    accepted, text = 0, ""
    for response in mlx_lm.stream_generate(model, tokenizer, prompt, max_tokens=max_tokens, **draft):
        stamps.append(time.perf_counter())
        accepted += int(response.from_draft)
        text += response.text
    return Run(len(stamps) - 1, stamps[-1] - stamps[0], len(stamps), accepted, text)


def greedy_stream(http: httpx.Client, model_id: str, ask: str, max_tokens: int) -> tuple[list[float], dict[str, Any], str]:
    """One streamed greedy chat through exo: when each piece of text came, the usage, the text."""
    body = {"model": model_id, "messages": [{"role": "user", "content": ask}], "temperature": 0,
            "max_tokens": max_tokens, "stream": True, "stream_options": {"include_usage": True}}
    stamps: list[float] = []
    usage: dict[str, Any] = {}
    text = ""
    with http.stream("POST", "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{model_id}: {response.status_code} {response.read().decode()}")
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            elif chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                stamps.append(time.perf_counter())
                text += chunk["choices"][0]["delta"]["content"]
    return stamps, usage, text


def cluster_run(http: httpx.Client, model_id: str, ask: str, max_tokens: int) -> Run:
    stamps, usage, text = greedy_stream(http, model_id, ask, max_tokens)
    tokens: int = usage["completion_tokens"]  # a chunk may carry several tokens (exo coalesces fast streams)
    accepted: int = usage.get("completion_tokens_details", {}).get("accepted_prediction_tokens", 0)
    return Run(tokens - 1, stamps[-1] - stamps[0], tokens, accepted, text)


def start_cluster(target: Path, draft: Path, root: Path, num_draft_tokens: int) -> tuple[FakeHub, ExoProcess]:
    hub = FakeHub({TINY_MODEL_ID: target, PLAIN_ID: target, DRAFT_ID: draft})
    env = {"HF_ENDPOINT": hub.start(), "HF_HOME": str(root / "hf"), "HF_HUB_DISABLE_TELEMETRY": "1",
           "EXO_LOG_LEVEL": "WARNING", "EXO_DISCOVERY": "0"}  # one node: never join another run's cluster
    exo = ExoProcess(root / "data", env).start()
    with httpx.Client(base_url=exo.url, timeout=300) as http:
        for model_id in (TINY_MODEL_ID, PLAIN_ID, DRAFT_ID):
            http.post("/models/add", json={"model_id": model_id}).raise_for_status()
        http.post("/place_instance", json={"model_id": TINY_MODEL_ID, "draft_model": DRAFT_ID,
                                           "num_draft_tokens": num_draft_tokens, "wait": True}).raise_for_status()
        http.post("/place_instance", json={"model_id": PLAIN_ID, "wait": True}).raise_for_status()
    return hub, exo


def forward_ms(model: Any, tokens: int, repeats: int = 10) -> float:
    """One forward pass over `tokens` new tokens after a 32-token prompt, in ms (the cache trimmed back each time)."""
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([[5] * 32]), cache=cache))
    start = time.perf_counter()
    for _ in range(repeats):
        mx.eval(model(mx.array([[7] * tokens]), cache=cache))
        for layer in cache:
            layer.trim(tokens)
    return (time.perf_counter() - start) / repeats * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--num-draft-tokens", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--intermediate", type=int, default=1408)
    parser.add_argument("--layers", type=int, default=8)
    args = parser.parse_args()
    dims = Dims(hidden=args.hidden, intermediate=args.intermediate, layers=args.layers, heads=8, kv_heads=4)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        target, draft_dir = make_models(root, dims)
        hub, exo = start_cluster(target, draft_dir, root, args.num_draft_tokens)
        try:
            runs, passes = measure(args, target, draft_dir, exo)
        finally:
            exo.interrupt()
            hub.stop()
    report(args, dims, runs, passes)


def measure(args: argparse.Namespace, target: Path, draft_dir: Path,
            exo: ExoProcess) -> tuple[dict[str, list[list[Run]]], tuple[float, float, float]]:
    """Per system, per run, one Run per prompt; and (target 1 token, target k+1 tokens, draft 1 token) in ms."""
    model, tokenizer = mlx_lm.load(str(target))
    draft_model, _ = mlx_lm.load(str(draft_dir))
    k = args.num_draft_tokens
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": ask}], add_generation_prompt=True,
                                             tokenize=False) for ask in ASKS]
    with_draft = {"draft_model": draft_model, "num_draft_tokens": k}
    runs: dict[str, list[list[Run]]] = {system: [] for system in SYSTEMS}
    with httpx.Client(base_url=exo.url, timeout=600) as http:

        def one(system: str, i: int, max_tokens: int) -> Run:
            if system.startswith("direct"):
                return direct_run(model, tokenizer, prompts[i], max_tokens, with_draft if "draft" in system else {})
            return cluster_run(http, TINY_MODEL_ID if "draft" in system else PLAIN_ID, ASKS[i], max_tokens)

        for system in SYSTEMS:  # warm every path: kernels, connections, the runners
            one(system, 0, 16)
        for n in range(args.runs):
            for system in SYSTEMS[n % 4:] + SYSTEMS[:n % 4]:  # rotate who goes first
                runs[system].append([one(system, i, args.max_tokens) for i in range(len(ASKS))])
    passes = (forward_ms(model, 1), forward_ms(model, k + 1), forward_ms(draft_model, 1))
    return runs, passes


def report(args: argparse.Namespace, dims: Dims, runs: dict[str, list[list[Run]]],
           passes: tuple[float, float, float]) -> None:
    def rate(system: str) -> tuple[float, float, float]:
        rates = [sum(r.decode_tokens for r in run) / sum(r.seconds for r in run) for run in runs[system]]
        return statistics.median(rates), min(rates), max(rates)

    def acceptance(system: str) -> float:
        done = [r for run in runs[system] for r in run]
        return sum(r.accepted for r in done) / sum(r.tokens for r in done)

    k = args.num_draft_tokens
    print(f"target: llama hidden={dims.hidden} intermediate={dims.intermediate} layers={dims.layers} float32; "
          f"draft: its 4-bit copy (mlx_lm.convert); {len(ASKS)} prompts x {args.max_tokens} tokens, greedy, "
          f"num_draft_tokens {k}, {args.runs} runs alternating")
    one, many, draft = passes
    print(f"forward pass: target 1 token {one:.1f} ms, {k + 1} tokens {many:.1f} ms ({many / one:.2f}x); "
          f"draft 1 token {draft:.1f} ms ({draft / one:.2f}x the target)")
    print("| system | plain tok/s | with draft tok/s | draft / plain | acceptance |")
    print("|---|---|---|---|---|")
    ratios = []
    for name, prefix in (("mlx-lm direct", "direct"), ("through exo", "exo")):
        (p, p_lo, p_hi), (d, d_lo, d_hi) = rate(f"{prefix} plain"), rate(f"{prefix} draft")
        ratios.append(d / p)
        print(f"| {name} | {p:.1f} [{p_lo:.1f}-{p_hi:.1f}] | {d:.1f} [{d_lo:.1f}-{d_hi:.1f}] | **{d / p:.2f}x** | "
              f"{acceptance(f'{prefix} draft'):.0%} |")
    texts = {system: [r.text for run in runs[system] for r in run] for system in SYSTEMS}
    same = all(texts[system] == texts["direct plain"] for system in SYSTEMS)
    print(f"greedy text identical across the four systems: {'yes' if same else 'NO'}; "
          f"load average (1 min) at the end: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    verdict = "measured" if min(ratios) > 1 else "missed" if max(ratios) < 1 else "mixed"
    print(f"speed-up: {verdict}. Expected here: none (CPU only: a pass over k+1 tokens costs nearly k+1 times one, "
          f"and a 4-bit draft is no cheaper than the target); on Apple silicon or CUDA (memory-bound decode) the "
          f"draft's k steps cost less than one target step and the speed-up follows the acceptance rate")


if __name__ == "__main__":
    main()
