"""Many LoRA adapters on one base (exo/runner/multi_lora.py): decode tokens/s of one batch of 8 rows
mixing 4 adapters, against the same batch all on 1 adapter, against mlx-lm's own LoRALinear with that
one adapter loaded (today's instance per adapter), and against the bare base; both per-row
strategies ("gather": mx.gather_mm over the stacked adapters; "grouped": a pair of matmuls per
adapter present). Each system decodes `--steps` greedy tokens per row after a 16-token prompt, the
systems alternating run by run (who goes first rotates); median [min-max] over `--runs` of tokens/s and
of tokens per CPU-second of this process.

Models: random llamas (tests/support/tiny_model.py, float32): the test suite's tiny one and
bench/adapters.py's (hidden 512, 8 layers, 25M parameters); `--size large`: one of 135M.
Adapters: `make_adapter`'s random LoRA on every linear layer of every block, rank `--rank`,
different seeds. Also printed: whether each system's greedy tokens equal mlx-lm's with the row's
adapter alone, and the parameter bytes of one instance holding 4 adapters against 4 instances of
one adapter each.

    uv run python -m bench.multi_lora [--runs 7] [--steps 16] [--rank 8] [--size tiny|medium|large|both]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import mlx.core as mx
import mlx_lm
from mlx.utils import tree_flatten
from mlx_lm.models.cache import make_prompt_cache

from exo.runner.multi_lora import MultiLoRA
from tests.support.adapters import make_adapter
from tests.support.tiny_model import Dims, make_tiny_model

ROWS = 8
PROMPT_TOKENS = 16
ADAPTERS = ["a0", "a1", "a2", "a3"]
MIXED = [ADAPTERS[i % 4] for i in range(ROWS)]  # interleaved: no adapter's rows are contiguous
# "medium" is bench/adapters.py's model (25M parameters). "large" (135M) is ~2.3 s per decode step of
# the batch on this 2-core machine under other sessions' load: minutes per run, so not by default.
SIZES = {"tiny": Dims(), "medium": Dims(hidden=512, intermediate=1408, layers=8, heads=8, kv_heads=4),
         "large": Dims(hidden=1024, intermediate=2816, layers=12, heads=16, kv_heads=4)}


def prompts(rows: list[int]) -> mx.array:
    return mx.array([[(7 * row + 3 * i) % 300 + 4 for i in range(PROMPT_TOKENS)] for row in rows])


class Spent(NamedTuple):
    """Seconds: on the clock, and of this process's CPU time (all its threads; what other sessions'
    load on this shared machine disturbs less)."""

    wall: float
    cpu: float


class Decoder:
    """A batch of `rows` on one model: the prompt prefilled once; each `run` decodes from there and
    trims the cache back. `ready` is called before each run (the converted model's systems share it:
    each sets its strategy and rows)."""

    def __init__(self, model: Any, rows: list[int], ready: Callable[[], None] = lambda: None) -> None:
        self.model, self.rows, self.ready = model, rows, ready
        ready()
        self.cache = make_prompt_cache(model)
        self.first = mx.argmax(model(prompts(rows), cache=self.cache)[:, -1, :], axis=-1)
        mx.eval(self.first)

    def run(self, steps: int) -> tuple[Spent, dict[int, list[int]]]:
        """The time `steps` greedy decode steps of the batch took, and each row's tokens."""
        self.ready()
        token, tokens = self.first, [self.first.tolist()]
        wall, cpu = time.perf_counter(), time.process_time()
        for _ in range(steps):
            token = mx.argmax(self.model(token[:, None], cache=self.cache)[:, -1, :], axis=-1)
            mx.eval(token)
            tokens.append(token.tolist())
        spent = Spent(time.perf_counter() - wall, time.process_time() - cpu)
        for layer in self.cache:
            layer.trim(steps)
        return spent, {row: list(column) for row, column in zip(self.rows, zip(*tokens, strict=True), strict=True)}


class Instances:
    """Today: an instance per adapter, each decoding its own rows; on one machine they take turns."""

    def __init__(self, decoders: list[Decoder]) -> None:
        self.decoders = decoders

    def run(self, steps: int) -> tuple[Spent, dict[int, list[int]]]:
        spent, tokens = Spent(0.0, 0.0), dict[int, list[int]]()
        for decoder in self.decoders:
            took, found = decoder.run(steps)
            spent, tokens = Spent(spent.wall + took.wall, spent.cpu + took.cpu), tokens | found
        return spent, tokens


System = Decoder | Instances
EVERY_ROW = list(range(ROWS))


def parameter_bytes(model: Any) -> int:
    return sum(value.nbytes for _, value in tree_flatten(model.parameters()))


def build(root: Path, dims: Dims, rank: int) -> tuple[Path, dict[str, Path]]:
    model_dir = make_tiny_model(root / "model", dims)
    return model_dir, {name: make_adapter(model_dir, root / name, seed=7 + i, rank=rank)
                       for i, name in enumerate(ADAPTERS)}


def systems(model_dir: Path, adapters: dict[str, Path]) -> tuple[dict[str, System], dict[str, int]]:
    """Each system, by name, with the adapter of each row; and the parameter bytes of what each holds."""
    base, _ = mlx_lm.load(str(model_dir))
    singles = {name: mlx_lm.load(str(model_dir), adapter_path=str(folder))[0] for name, folder in adapters.items()}
    converted, _ = mlx_lm.load(str(model_dir))
    lora = MultiLoRA(converted)
    for name, folder in adapters.items():
        lora.add_folder(name, folder)

    def on(strategy: str, rows: list[str | None]) -> Decoder:
        def ready() -> None:
            lora.batch.strategy = strategy  # type: ignore[assignment]  # one of the two Strategy values
            lora.select(rows)
        return Decoder(converted, EVERY_ROW, ready)

    table: dict[str, System] = {
        "base": Decoder(base, EVERY_ROW), "mlx-lm LoRALinear, 1 adapter": Decoder(singles["a0"], EVERY_ROW),
        "4 mlx-lm instances, 1 adapter each, 2 rows each": Instances(
            [Decoder(singles[name], [r for r in EVERY_ROW if MIXED[r] == name]) for name in ADAPTERS]),
        "converted, no adapter": on("gather", [None] * ROWS)}
    for strategy in ("gather", "grouped"):
        table[f"{strategy}, 1 adapter"] = on(strategy, ["a0"] * ROWS)
        table[f"{strategy}, 4 adapters"] = on(strategy, list(MIXED))
    held = {"base": parameter_bytes(base), "one adapter": parameter_bytes(singles["a0"]),
            "converted": parameter_bytes(converted)}
    return table, held


def rows_of(system: str) -> list[str | None]:
    if system == "base" or "no adapter" in system:
        return [None] * ROWS
    return list(MIXED) if "4 " in system else ["a0"] * ROWS


def expected(model_dir: Path, adapters: dict[str, Path], steps: int) -> dict[tuple[str | None, int], list[int]]:
    """mlx-lm's greedy tokens per (adapter, row) with that adapter alone loaded (None: the base)."""
    want: dict[tuple[str | None, int], list[int]] = {}
    for name in [None, *ADAPTERS]:
        model, _ = mlx_lm.load(str(model_dir), adapter_path=None if name is None else str(adapters[name]))
        _, tokens = Decoder(model, EVERY_ROW).run(steps)
        want |= {(name, row): found for row, found in tokens.items()}
    return want


def measure(model_dir: Path, adapters: dict[str, Path], runs: int, steps: int) -> None:
    want = expected(model_dir, adapters, steps)
    table, held = systems(model_dir, adapters)
    rates: dict[str, list[Spent]] = {name: [] for name in table}
    exact = {}
    for name, system in table.items():  # warm every path (kernels), and check its tokens
        _, tokens = system.run(steps)
        exact[name] = all(tokens[row] == want[(adapter, row)] for row, adapter in enumerate(rows_of(name)))
    names = list(table)
    for n in range(runs):
        for name in names[n % len(names):] + names[:n % len(names)]:
            spent, _ = table[name].run(steps)
            rates[name].append(Spent(ROWS * steps / spent.wall, ROWS * steps / spent.cpu))
    report(rates, exact, held, runs)


def report(rates: dict[str, list[Spent]], exact: dict[str, bool], held: dict[str, int], runs: int) -> None:
    def shown(values: list[float], base: list[float]) -> str:
        median = statistics.median(values)
        return f"{median:.1f} [{min(values):.1f}-{max(values):.1f}] | {median / statistics.median(base):.2f}x"

    print(f"| system (batch of {ROWS}), n={runs} | decode tok/s, median [min-max] | / base "
          "| tok per CPU-second | / base | tokens = mlx-lm's |")
    print("|---|---|---|---|---|---|")
    for name, values in rates.items():
        walls, cpus = [v.wall for v in values], [v.cpu for v in values]
        print(f"| {name} | {shown(walls, [v.wall for v in rates['base']])} | "
              f"{shown(cpus, [v.cpu for v in rates['base']])} | {'yes' if exact[name] else 'NO'} |")
    mib = 2**20
    print(f"parameters: base {held['base'] / mib:.2f} MiB; one instance with the 4 adapters "
          f"{held['converted'] / mib:.2f} MiB; 4 instances of one adapter each {4 * held['one adapter'] / mib:.2f} MiB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--size", choices=[*SIZES, "both"], default="both", help="both: tiny and medium")
    args = parser.parse_args()
    for size in ["tiny", "medium"] if args.size == "both" else [args.size]:
        dims = SIZES[size]
        with tempfile.TemporaryDirectory() as tmp:
            model_dir, adapters = build(Path(tmp), dims, args.rank)
            print(f"\n{size}: llama hidden={dims.hidden} intermediate={dims.intermediate} layers={dims.layers} "
                  f"float32; 4 adapters: LoRA rank {args.rank} on every linear of every block; {args.steps} decode "
                  f"steps after a {PROMPT_TOKENS}-token prompt, greedy; systems alternating")
            measure(model_dir, adapters, args.runs, args.steps)
    print(f"load average (1 min) at the end: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")


if __name__ == "__main__":
    main()
