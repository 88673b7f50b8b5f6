"""Many adapters on one base through the cluster (#48 part 1): one node, one instance of the base
serving adapters b1..b4 per row (EXO_ADAPTERS_SHARE_BASE, the default), and instances of their own
for adapters a1..a4 (placed explicitly: an adapter's own instance is preferred to its base's).
Both layouts live in one cluster, so their rounds alternate (who goes first rotates).

One round: 4 concurrent greedy streamed chats, one per adapter of a layout; tokens/s = the
completion tokens of all 4 / the round's wall time, and / the CPU seconds the layout's runner
processes spent in the round (what other sessions' load on a shared machine disturbs least: 4
processes get a larger share of a busy machine than 1). Memory: the resident set (VmRSS) of the
runner processes, after one request per adapter and again after every round: the base's runner
with 3 adapters and with 4, against the sum of 3 and of 4 per-adapter runners (each a whole
process: Python, mlx, the base's weights, the adapter).
Greedy text of each adapter through the base equals the text of the same adapter's own instance
(checked every round: the two layouts hold the same 4 adapters, seeds 1..4).

    uv run python -m bench.adapters_share [--runs 5] [--max-tokens 48] [--rank 8]
                                          [--hidden 512 --intermediate 1408 --layers 8]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

import httpx

from bench.on_demand import runner_processes
from bench.scale import cpu_seconds, rss_mib
from bench.speculative import greedy_stream
from tests.support.adapters import make_adapter
from tests.support.exo_process import ExoProcess
from tests.support.fake_hub import FakeHub
from tests.support.tiny_model import TINY_MODEL_ID, Dims, make_tiny_model

ADAPTERS = 4
ASK = "Write a short story about a lighthouse keeper and the sea."
LAYOUTS = {"one base instance": "b", "an instance per adapter": "a"}


def adapter_ids(prefix: str) -> list[str]:
    return [f"{TINY_MODEL_ID}:{prefix}{n}" for n in range(1, ADAPTERS + 1)]


def add_adapters(http: httpx.Client, adapter_dirs: list[Path]) -> None:
    """The same 4 adapters under both layouts' names."""
    for prefix in LAYOUTS.values():
        for n, folder in enumerate(adapter_dirs, start=1):
            files = {"config": ("adapter_config.json", (folder / "adapter_config.json").read_bytes()),
                     "weights": ("adapters.safetensors", (folder / "adapters.safetensors").read_bytes())}
            http.post("/adapters", data={"name": f"{prefix}{n}", "base_model": TINY_MODEL_ID},
                      files=files).raise_for_status()


def place(http: httpx.Client, exo: ExoProcess, model_id: str) -> int:
    """Place one instance and return the pid of the runner it started (the one not there before)."""
    before = set(runner_processes(exo))
    http.post("/place_instance", json={"model_id": model_id, "wait": True}).raise_for_status()
    [pid] = set(runner_processes(exo)) - before
    return pid


class Round(NamedTuple):
    per_second: float  # completion tokens / wall seconds
    per_cpu_second: float  # completion tokens / the runners' CPU seconds
    texts: list[str]


def one_round(http: httpx.Client, models: list[str], pids: list[int], max_tokens: int) -> Round:
    """4 concurrent requests, one per model, served by the runners `pids`."""
    cpu, start = sum(map(cpu_seconds, pids)), time.perf_counter()
    with ThreadPoolExecutor(len(models)) as pool:
        answers = list(pool.map(lambda model: greedy_stream(http, model, ASK, max_tokens), models))
    seconds, cpu = time.perf_counter() - start, sum(map(cpu_seconds, pids)) - cpu
    tokens = sum(usage["completion_tokens"] for _, usage, _ in answers)
    return Round(tokens / seconds, tokens / cpu, [text for *_, text in answers])


def memory(base_pid: int, own_pids: list[int]) -> str:
    own = [rss_mib(pid) for pid in own_pids]
    return (f"one base instance {rss_mib(base_pid):.0f} MiB with 4 adapters; per-adapter instances: 3 "
            f"{sum(own[:3]):.0f} MiB, 4 {sum(own):.0f} MiB (each {', '.join(f'{r:.0f}' for r in own)})")


def measure(args: argparse.Namespace, exo: ExoProcess, adapter_dirs: list[Path]) -> None:
    with httpx.Client(base_url=exo.url, timeout=600) as http:
        http.post("/models/add", json={"model_id": TINY_MODEL_ID}).raise_for_status()
        add_adapters(http, adapter_dirs)
        base_pid = place(http, exo, TINY_MODEL_ID)
        own_pids = [place(http, exo, model_id) for model_id in adapter_ids("a")]
        for model in adapter_ids("a"):
            greedy_stream(http, model, ASK, 8)
        shared = adapter_ids("b")
        for model in shared[:3]:  # the base's runner takes its first 3 adapters
            greedy_stream(http, model, ASK, 8)
        with_3 = rss_mib(base_pid)
        greedy_stream(http, shared[3], ASK, 8)
        before = f"one base instance with 3 adapters {with_3:.0f} MiB; " + memory(base_pid, own_pids)
        pids = {"one base instance": [base_pid], "an instance per adapter": own_pids}
        rounds: dict[str, list[Round]] = {layout: [] for layout in LAYOUTS}
        for n in range(args.runs):
            for layout in list(LAYOUTS)[n % 2:] + list(LAYOUTS)[:n % 2]:
                rounds[layout].append(one_round(http, adapter_ids(LAYOUTS[layout]), pids[layout], args.max_tokens))
        report(args, rounds, before, memory(base_pid, own_pids))


def shown(values: list[float]) -> str:
    return f"{statistics.median(values):.1f} [{min(values):.1f}-{max(values):.1f}]"


def report(args: argparse.Namespace, rounds: dict[str, list[Round]], before: str, after: str) -> None:
    print(f"llama hidden={args.hidden} intermediate={args.intermediate} layers={args.layers} float32; "
          f"{ADAPTERS} LoRA adapters rank {args.rank} on every linear; {ADAPTERS} concurrent greedy chats x "
          f"{args.max_tokens} tokens per round; {args.runs} rounds per layout, alternating")
    print("| layout, 4 concurrent requests | n | tok/s, median [min-max] | tok per runner CPU-s |")
    print("|---|---|---|---|")
    for layout, done in rounds.items():
        print(f"| {layout} | {len(done)} | {shown([r.per_second for r in done])} | "
              f"{shown([r.per_cpu_second for r in done])} |")
    print(f"runner RSS after one request per adapter: {before}")
    print(f"runner RSS after every round: {after}")
    same = [a.texts == b.texts for a, b in zip(*rounds.values(), strict=True)]
    print(f"greedy text, each adapter through the base vs its own instance: "
          f"{'identical' if all(same) else 'MISMATCH'} in every round")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--intermediate", type=int, default=1408)
    parser.add_argument("--layers", type=int, default=8)
    args = parser.parse_args()
    dims = Dims(hidden=args.hidden, intermediate=args.intermediate, layers=args.layers, heads=8, kv_heads=4)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model_dir = make_tiny_model(root / "model", dims)
        adapter_dirs = [make_adapter(model_dir, root / f"adapter{n}", seed=n, rank=args.rank)
                        for n in range(1, ADAPTERS + 1)]
        hub = FakeHub({TINY_MODEL_ID: model_dir})
        env = {"HF_ENDPOINT": hub.start(), "HF_HOME": str(root / "hf"), "HF_HUB_DISABLE_TELEMETRY": "1",
               "EXO_LOG_LEVEL": "WARNING", "EXO_DISCOVERY": "0"}  # one node: never join another run's cluster
        exo = ExoProcess(root / "data", env).start()
        try:
            measure(args, exo, adapter_dirs)
        finally:
            exo.interrupt()
            hub.stop()


if __name__ == "__main__":
    main()
