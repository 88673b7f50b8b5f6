"""What alternating benches share: the order they measure the systems compared in, and the table
they print at the end (per system, the median and the range of each measure over its runs)."""

from __future__ import annotations

import statistics
from collections.abc import Iterator


def median_range(values: list[float]) -> str:
    return f"{statistics.median(values):.0f} [{min(values):.0f}-{max(values):.0f}]"


def print_medians(columns: list[tuple[str, int]], results: dict[str, list[dict[str, float]]], keys: list[str]) -> None:
    """`columns`: (heading, width) of the name column, then one per key in `keys`."""
    print("  ".join(f"{heading:>{width}}" for heading, width in columns))
    for name, runs in results.items():
        cells = [name, *(median_range([run[key] for run in runs]) for key in keys)]
        print("  ".join(f"{cell:>{width}}" for cell, (_, width) in zip(cells, columns)))


def alternating(systems: list[str], runs: int) -> Iterator[tuple[int, str]]:
    """(run, system) in the order benches measure them: forwards on even runs, backwards on odd
    ones, so neither system always goes first (warm caches, a machine that heats up)."""
    for run in range(runs):
        for system in systems if run % 2 == 0 else list(reversed(systems)):
            yield run, system
