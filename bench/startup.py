"""What a node costs to start: CPU seconds and wall seconds from launch to `node ready`, for a node
with no model (its worker, master and API), --runs times, median and range. With --compare DIR,
the same for the exo sources in DIR (a checkout of another commit, imported through PYTHONPATH),
the two alternating.

    uv run python -m bench.startup [--runs 5] [--compare /path/to/other/checkout]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

from tests.support.cluster import NatsServer, start_node


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def one_start(root: Path, nats_url: str, source: str | None) -> tuple[float, float]:
    """(CPU seconds, wall seconds) of one node's start, up to `node ready`."""
    env = {"PYTHONPATH": source} if source else {}
    started = time.perf_counter()
    node = start_node(root, "node", nats_url, env=env)
    wall = time.perf_counter() - started
    assert node.process is not None
    cpu = _cpu_seconds(node.process.pid)
    node.interrupt()
    return cpu, wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--compare", help="another checkout's root, measured alternately")
    args = parser.parse_args()
    sides = {"this checkout": None, **({f"{args.compare}": args.compare} if args.compare else {})}
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in sides}
    with tempfile.TemporaryDirectory(prefix="exo-startup-") as tmp:
        for run in range(args.runs):
            for name, source in sides.items():
                root = Path(tmp) / f"{run}-{len(samples[name])}-{abs(hash(name))}"
                nats = NatsServer(root / "nats")
                try:
                    samples[name].append(one_start(root, nats.url, source))
                finally:
                    nats.stop()
    for name, values in samples.items():
        cpu, wall = [v[0] for v in values], [v[1] for v in values]
        print(f"{name}: CPU to node ready median {statistics.median(cpu):.2f} s ({min(cpu):.2f}-{max(cpu):.2f}), "
              f"wall median {statistics.median(wall):.2f} s ({min(wall):.2f}-{max(wall):.2f}), {len(values)} starts")


if __name__ == "__main__":
    main()
