"""The embedded nats-server's memory under large messages, with and without a Go memory limit.

Each run starts a fresh embedded server (a temp store), stores --images images of 10 MB, reads
half of them back, publishes --big 8 MB token messages, then samples the server's RSS (peak and
10 s later) and times the reads. The limits alternate run by run ("off" is no limit, as before
EXO_NATS_MEMORY_LIMIT); medians with ranges over --runs runs each.

    uv run python -m bench.nats_memory [--runs 3] [--images 40] [--big 10] [--limits off 256MiB 64MiB]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time
from pathlib import Path

from bench.summary import alternating, print_medians
from exo.bus.connection import connect
from exo.bus.images import fetch_image, store_image
from exo.bus.provision import provision
from exo.bus.server.embedded import EmbeddedNats


def rss_mb(pid: int) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS"):
            return int(line.split()[1]) // 1024
    return 0


async def one_run(limit: str, images: int, big: int) -> dict[str, float]:
    os.environ["GOMEMLIMIT"] = limit  # the embedded server takes GOMEMLIMIT from the environment first
    with tempfile.TemporaryDirectory() as store:
        server = EmbeddedNats(Path(store) / "nats", port=0)
        nc = await connect([await server.start()], name="bench")
        await provision(nc)
        assert server.process is not None  # started above
        pid, peak = server.process.pid, 0
        digests = [(await store_image(nc, os.urandom(10 * 1024 * 1024)))[0] for _ in range(images)]
        peak = max(peak, rss_mb(pid))
        started = time.perf_counter()
        for digest in digests[: images // 2]:
            await fetch_image(nc, digest)
            peak = max(peak, rss_mb(pid))
        read_s = time.perf_counter() - started
        payload = b"x" * (8 * 1024 * 1024)
        for _ in range(big):
            await nc.jetstream().publish("exo.tokens.bench", payload)
            peak = max(peak, rss_mb(pid))
        await asyncio.sleep(10)
        settled = rss_mb(pid)
        await nc.close()
        server.stop()
    return {"peak": peak, "settled": settled, "read_mb_s": images // 2 * 10 / read_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--images", type=int, default=40)
    parser.add_argument("--big", type=int, default=10)
    parser.add_argument("--limits", nargs="+", default=["off", "256MiB", "64MiB"])
    args = parser.parse_args()
    results: dict[str, list[dict[str, float]]] = {limit: [] for limit in args.limits}
    for run, limit in alternating(args.limits, args.runs):
        results[limit].append(asyncio.run(one_run(limit, args.images, args.big)))
        print(f"run {run + 1} {limit}: {results[limit][-1]}", flush=True)
    print(f"\n{args.images} images of 10 MB stored, {args.images // 2} read back, {args.big} messages of 8 MB; "
          f"{args.runs} runs each, median [min-max]")
    print_medians([("GOMEMLIMIT", 10), ("peak RSS MB", 18), ("RSS 10 s later MB", 18), ("image reads MB/s", 18)],
                  results, ["peak", "settled", "read_mb_s"])


if __name__ == "__main__":
    main()
