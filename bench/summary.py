"""The table every alternating bench prints at its end: per system compared, the median and the
range of each measure over its runs."""

from __future__ import annotations

import statistics


def median_range(values: list[float]) -> str:
    return f"{statistics.median(values):.0f} [{min(values):.0f}-{max(values):.0f}]"


def print_medians(columns: list[tuple[str, int]], results: dict[str, list[dict[str, float]]], keys: list[str]) -> None:
    """`columns`: (heading, width) of the name column, then one per key in `keys`."""
    print("  ".join(f"{heading:>{width}}" for heading, width in columns))
    for name, runs in results.items():
        cells = [name, *(median_range([run[key] for run in runs]) for key in keys)]
        print("  ".join(f"{cell:>{width}}" for cell, (_, width) in zip(cells, columns)))
