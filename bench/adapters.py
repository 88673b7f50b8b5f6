"""LoRA adapters: decode tokens/s of a base model and of the same model with an adapter, side by side
in one run, (a) with mlx-lm's stream_generate in this process (`mlx_lm.load(path)` and
`mlx_lm.load(path, adapter_path=...)`) and (b) through `exo`'s OpenAI API (one node, a fake Hub
serving the model; the adapter uploaded to POST /adapters; one instance of the base, one of
"<base>:<adapter>"). Greedy, the same prompts; the four systems alternate run by run.

The model is a random llama (tests/support/tiny_model.py, float32); the adapter is a random mlx-lm
LoRA adapter on every linear layer of every block (tests/support/adapters.py), strong enough that
its greedy text differs from the base's. Target: exo with the adapter reaches at least 0.9 of
mlx-lm's own tokens/s with the adapter loaded, and its greedy text is mlx-lm's, token for token.
"adapter / base" is what the LoRA layers themselves cost (two extra small matmuls per linear layer).

    uv run python -m bench.adapters [--runs 5] [--max-tokens 96] [--rank 8]
                                    [--hidden 512 --intermediate 1408 --layers 8]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, NamedTuple

import httpx
import mlx.core as mx
import mlx_lm
from mlx_lm.models.cache import make_prompt_cache

from bench.speculative import greedy_stream
from tests.support.adapters import make_adapter
from tests.support.exo_process import ExoProcess
from tests.support.fake_hub import FakeHub
from tests.support.tiny_model import TINY_MODEL_ID, Dims, make_tiny_model

ADAPTER = "bench-lora"
ADAPTER_ID = f"{TINY_MODEL_ID}:{ADAPTER}"
ASKS = ["Write a short story about a lighthouse keeper and the sea.", "What is the capital of France?"]
SYSTEMS = ["direct base", "direct adapter", "exo base", "exo adapter"]
TARGET = 0.9  # exo adapter / direct adapter


class Run(NamedTuple):
    """One request: decode tokens (after the first), their seconds, generated tokens, text."""

    decode_tokens: int
    seconds: float
    tokens: int
    text: str


class Placed(NamedTuple):
    """What placement counted for an instance's one rank: weights and KV cache, in bytes."""

    weights_bytes: int
    kv_bytes: int


def direct_run(model: Any, tokenizer: Any, prompt: str, max_tokens: int) -> Run:
    """`model`, `tokenizer`: what mlx_lm.load returns (mypy does not follow mlx_lm: see pyproject.toml)."""
    stamps: list[float] = []
    text = ""
    for response in mlx_lm.stream_generate(model, tokenizer, prompt, max_tokens=max_tokens):
        stamps.append(time.perf_counter())
        text += response.text
    return Run(len(stamps) - 1, stamps[-1] - stamps[0], len(stamps), text)


def cluster_run(http: httpx.Client, model_id: str, ask: str, max_tokens: int) -> Run:
    stamps, usage, text = greedy_stream(http, model_id, ask, max_tokens)
    tokens: int = usage["completion_tokens"]  # a chunk may carry several tokens (exo coalesces fast streams)
    return Run(tokens - 1, stamps[-1] - stamps[0], tokens, text)


def placed(answer: httpx.Response) -> Placed:
    answer.raise_for_status()
    [shard] = answer.json()["instance"]["shards"]  # one node: one rank
    return Placed(int(shard["memory_bytes"]), int(shard["kv_bytes"]))


def start_cluster(model_dir: Path, adapter_dir: Path, root: Path) -> tuple[FakeHub, ExoProcess, dict[str, Placed]]:
    hub = FakeHub({TINY_MODEL_ID: model_dir})
    env = {"HF_ENDPOINT": hub.start(), "HF_HOME": str(root / "hf"), "HF_HUB_DISABLE_TELEMETRY": "1",
           "EXO_LOG_LEVEL": "WARNING", "EXO_DISCOVERY": "0"}  # one node: never join another run's cluster
    exo = ExoProcess(root / "data", env).start()
    files = {"config": ("adapter_config.json", (adapter_dir / "adapter_config.json").read_bytes()),
             "weights": ("adapters.safetensors", (adapter_dir / "adapters.safetensors").read_bytes())}
    with httpx.Client(base_url=exo.url, timeout=300) as http:
        http.post("/models/add", json={"model_id": TINY_MODEL_ID}).raise_for_status()
        http.post("/adapters", data={"name": ADAPTER, "base_model": TINY_MODEL_ID}, files=files).raise_for_status()
        memory = {model_id: placed(http.post("/place_instance", json={"model_id": model_id, "wait": True}))
                  for model_id in (TINY_MODEL_ID, ADAPTER_ID)}
    return hub, exo, memory


def forward_ms(model: Any, repeats: int = 10) -> float:
    """One forward pass over 1 new token after a 32-token prompt, in ms (the cache trimmed back each time)."""
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([[5] * 32]), cache=cache))
    start = time.perf_counter()
    for _ in range(repeats):
        mx.eval(model(mx.array([[7]]), cache=cache))
        for layer in cache:
            layer.trim(1)
    return (time.perf_counter() - start) / repeats * 1000


def forward_pair_ms(base: Any, adapted: Any, rounds: int = 7) -> tuple[float, float]:
    """Median of `rounds` alternating measurements of forward_ms: (the base, with the adapter)."""
    pairs = [(forward_ms(base), forward_ms(adapted)) for _ in range(rounds)]
    return statistics.median(p[0] for p in pairs), statistics.median(p[1] for p in pairs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--intermediate", type=int, default=1408)
    parser.add_argument("--layers", type=int, default=8)
    args = parser.parse_args()
    dims = Dims(hidden=args.hidden, intermediate=args.intermediate, layers=args.layers, heads=8, kv_heads=4)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model_dir = make_tiny_model(root / "model", dims)
        adapter_dir = make_adapter(model_dir, root / "adapter", rank=args.rank)
        adapter_bytes = (adapter_dir / "adapters.safetensors").stat().st_size
        hub, exo, memory = start_cluster(model_dir, adapter_dir, root)
        try:
            runs, passes = measure(args, model_dir, adapter_dir, exo)
        finally:
            exo.interrupt()
            hub.stop()
    report(args, dims, runs, passes, memory, adapter_bytes)


def measure(args: argparse.Namespace, model_dir: Path, adapter_dir: Path,
            exo: ExoProcess) -> tuple[dict[str, list[list[Run]]], tuple[float, float]]:
    """Per system, per run, one Run per prompt; and one forward pass of 1 token (base, with the adapter) in ms."""
    base, tokenizer = mlx_lm.load(str(model_dir))
    adapted, _ = mlx_lm.load(str(model_dir), adapter_path=str(adapter_dir))
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": ask}], add_generation_prompt=True,
                                             tokenize=False) for ask in ASKS]
    runs: dict[str, list[list[Run]]] = {system: [] for system in SYSTEMS}
    with httpx.Client(base_url=exo.url, timeout=600) as http:

        def one(system: str, i: int, max_tokens: int) -> Run:
            if system.startswith("direct"):
                return direct_run(adapted if "adapter" in system else base, tokenizer, prompts[i], max_tokens)
            return cluster_run(http, ADAPTER_ID if "adapter" in system else TINY_MODEL_ID, ASKS[i], max_tokens)

        for system in SYSTEMS:  # warm every path: kernels, connections, the runners
            one(system, 0, 16)
        for n in range(args.runs):
            for system in SYSTEMS[n % 4:] + SYSTEMS[:n % 4]:  # rotate who goes first
                runs[system].append([one(system, i, args.max_tokens) for i in range(len(ASKS))])
    return runs, forward_pair_ms(base, adapted)


def mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def report(args: argparse.Namespace, dims: Dims, runs: dict[str, list[list[Run]]], passes: tuple[float, float],
           memory: dict[str, Placed], adapter_bytes: int) -> None:
    def rate(system: str) -> tuple[float, float, float]:
        rates = [sum(r.decode_tokens for r in run) / sum(r.seconds for r in run) for run in runs[system]]
        return statistics.median(rates), min(rates), max(rates)

    def shown(system: str) -> str:
        median, lo, hi = rate(system)
        return f"{median:.1f} [{lo:.1f}-{hi:.1f}]"

    print(f"model: llama hidden={dims.hidden} intermediate={dims.intermediate} layers={dims.layers} float32; "
          f"adapter: LoRA rank {args.rank} on every linear layer of all {dims.layers} layers ({mib(adapter_bytes)}); "
          f"{len(ASKS)} prompts x {args.max_tokens} tokens, greedy, {args.runs} runs alternating (n = {args.runs} "
          f"per system, each over {len(ASKS)} requests)")
    base_ms, adapter_ms = passes
    print(f"forward pass, 1 token: base {base_ms:.1f} ms, with the adapter {adapter_ms:.1f} ms "
          f"({adapter_ms / base_ms:.2f}x)")
    print("| system | base tok/s | adapter tok/s | adapter / base |")
    print("|---|---|---|---|")
    for name, prefix in (("mlx-lm direct", "direct"), ("through exo", "exo")):
        b, a = rate(f"{prefix} base")[0], rate(f"{prefix} adapter")[0]
        print(f"| {name} | {shown(f'{prefix} base')} | {shown(f'{prefix} adapter')} | **{a / b:.2f}x** |")
    ratio = rate("exo adapter")[0] / rate("direct adapter")[0]
    base_ratio = rate("exo base")[0] / rate("direct base")[0]
    print(f"exo adapter / direct adapter: **{ratio:.3f}x** (target >= {TARGET}: {'met' if ratio >= TARGET else 'MISSED'}); "
          f"exo base / direct base: {base_ratio:.3f}x")
    texts = {system: [r.text for run in runs[system] for r in run] for system in SYSTEMS}
    same = texts["exo adapter"] == texts["direct adapter"]
    base_same = texts["exo base"] == texts["direct base"]
    differs = texts["direct adapter"] != texts["direct base"]
    print(f"greedy text, exo adapter vs direct adapter: {'identical' if same else 'MISMATCH'}; exo base vs direct "
          f"base: {'identical' if base_same else 'MISMATCH'}; adapter text differs from the base's: "
          f"{'yes' if differs else 'NO (the adapter is not at work)'}")
    base_placed, adapter_placed = memory[TINY_MODEL_ID], memory[ADAPTER_ID]
    print(f"memory placement counted: base instance {mib(base_placed.weights_bytes)} weights + "
          f"{mib(base_placed.kv_bytes)} KV; adapter instance {mib(adapter_placed.weights_bytes)} weights + "
          f"{mib(adapter_placed.kv_bytes)} KV (+{mib(adapter_placed.weights_bytes - base_placed.weights_bytes)}: "
          f"the adapter's weights, beside its own copy of the base's); load average (1 min) at the end: "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")


if __name__ == "__main__":
    main()
