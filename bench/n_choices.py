"""n choices in one request against n separate requests: one exo node, one instance of a random
llama (tests/support/tiny_model.py, float32), the OpenAI chat API, not streamed.

(a) "one request, n=4": the runner prefills the prompt once and decodes 4 rows from it
    (exo/runner/choices.py);
(b) "4 requests": 4 concurrent requests of the same prompt, n=1, which the runner batches too but
    prefills 4 times.
Sampled (temperature 1, choice i / request i seeded with seed + i, so both give the same texts:
checked), the prompt cache off (EXO_PROMPT_CACHE_BYTES=0) so it helps neither. The two alternate
run by run; tokens/s is completion tokens over the wall time from sending to the last
answer; median [min-max] over the runs.

    uv run python -m bench.n_choices [--runs 5] [--n 4] [--prompt-words 300] [--max-tokens 64]
                                     [--hidden 256 --intermediate 704 --layers 4]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from tests.support.exo_process import ExoProcess
from tests.support.fake_hub import FakeHub
from tests.support.tiny_model import TINY_MODEL_ID, Dims, make_tiny_model

SYSTEMS = ["one request, n", "n requests"]
SEED = 1000


def ask(run: int, words: int) -> list[dict[str, str]]:
    filler = " ".join(["the sea and the sky over the old harbour"] * (words // 8))
    return [{"role": "user", "content": f"Run {run}: tell me a story. {filler}"}]


def chat(http: httpx.Client, messages: list[dict[str, str]], max_tokens: int, n: int, seed: int) -> dict[str, Any]:
    body = {"model": TINY_MODEL_ID, "messages": messages, "max_tokens": max_tokens, "temperature": 1.0,
            "seed": seed, "n": n}
    response = http.post("/v1/chat/completions", json=body)
    if response.status_code != 200:
        raise RuntimeError(f"n={n}: {response.status_code} {response.text}")
    answer: dict[str, Any] = response.json()
    return answer


def one_run(http: httpx.Client, system: str, messages: list[dict[str, str]], args: argparse.Namespace) -> tuple[float, list[str]]:
    """Completion tokens/s over the wall time, and the texts (choice or request order)."""
    start = time.perf_counter()
    if system == SYSTEMS[0]:
        answers = [chat(http, messages, args.max_tokens, args.n, SEED)]
    else:
        with ThreadPoolExecutor(args.n) as pool:
            answers = list(pool.map(lambda i: chat(http, messages, args.max_tokens, 1, SEED + i), range(args.n)))
    seconds = time.perf_counter() - start
    tokens = sum(a["usage"]["completion_tokens"] for a in answers)
    return tokens / seconds, [c["message"]["content"] for a in answers for c in a["choices"]]


def start_node(model: Path, root: Path) -> tuple[FakeHub, ExoProcess]:
    hub = FakeHub({TINY_MODEL_ID: model})
    env = {"HF_ENDPOINT": hub.start(), "HF_HOME": str(root / "hf"), "HF_HUB_DISABLE_TELEMETRY": "1",
           "EXO_LOG_LEVEL": "WARNING", "EXO_DISCOVERY": "0",  # one node: never join another run's cluster
           "EXO_PROMPT_CACHE_BYTES": "0"}  # every request prefills its prompt: what n > 1 saves is visible
    exo = ExoProcess(root / "data", env).start()
    with httpx.Client(base_url=exo.url, timeout=300) as http:
        http.post("/models/add", json={"model_id": TINY_MODEL_ID}).raise_for_status()
        http.post("/place_instance", json={"model_id": TINY_MODEL_ID, "wait": True}).raise_for_status()
    return hub, exo


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--prompt-words", type=int, default=300)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--intermediate", type=int, default=704)
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()
    dims = Dims(hidden=args.hidden, intermediate=args.intermediate, layers=args.layers, heads=8, kv_heads=4)
    rates: dict[str, list[float]] = {system: [] for system in SYSTEMS}
    same = True
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        hub, exo = start_node(make_tiny_model(root / "model", dims), root)
        try:
            with httpx.Client(base_url=exo.url, timeout=600) as http:
                for system in SYSTEMS:  # warm both paths
                    one_run(http, system, ask(-1, 40), argparse.Namespace(**{**vars(args), "max_tokens": 4}))
                for run in range(args.runs):
                    texts = []
                    for system in SYSTEMS[run % 2:] + SYSTEMS[:run % 2]:  # alternate who goes first
                        rate, text = one_run(http, system, ask(run, args.prompt_words), args)
                        rates[system].append(rate)
                        texts.append(text)
                    same = same and texts[0] == texts[1] and len(texts[0]) == args.n
        finally:
            exo.interrupt()
            hub.stop()
    report(args, dims, rates, same)


def report(args: argparse.Namespace, dims: Dims, rates: dict[str, list[float]], same: bool) -> None:
    print(f"model: llama hidden={dims.hidden} intermediate={dims.intermediate} layers={dims.layers} float32; "
          f"prompt ~{args.prompt_words} words, {args.max_tokens} tokens a choice, n={args.n}, temperature 1, "
          f"{args.runs} runs alternating")
    print("| system | completion tok/s |")
    print("|---|---|")
    for system in SYSTEMS:
        values = rates[system]
        print(f"| {system} = {args.n} | {statistics.median(values):.1f} [{min(values):.1f}-{max(values):.1f}] |")
    ratio = statistics.median(rates[SYSTEMS[0]]) / statistics.median(rates[SYSTEMS[1]])
    print(f"one request / separate requests: {ratio:.2f}x; the same {args.n} texts both ways in every run: "
          f"{'yes' if same else 'NO'}; load average (1 min) at the end: {os.getloadavg()[0]:.1f} "
          f"on {os.cpu_count()} cores")


if __name__ == "__main__":
    main()
