"""Zero-config clusters (issue #21), in one run on this machine (nodes on 127.0.0.1, mDNS on
127.0.0.1, each `exo` a process of its own with its data dir):

1. time from process start to "serving in the cluster" (the API answers /v1/models) for the
   1st, 2nd and 3rd node started one after the other, and for three started at once;
2. the write outage when the node leading a replicated stream is killed (kill -9 of exo and its
   nats-servers): a writer connected to a surviving node appends without pause, and the longest
   gap between two acknowledged appends is the outage;
3. appends per second to an R3 and an R1 stream of the same cluster, alternated.

    uv run python -m bench.discovery [--rounds 3] [--appends 2000]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import httpx

from exo.bus.connection import Connection, connect
from exo.bus.server.server_config import NODE_TAG
from tests.support.exo_process import ExoProcess
from tests.support.healing import kill_9, stop_all


def env(namespace: str) -> dict[str, str]:
    return {"EXO_DISCOVERY": "1", "EXO_DISCOVERY_ADDRESS": "127.0.0.1", "EXO_NAMESPACE": namespace}


def serving_after(node: ExoProcess, started: float, timeout: float = 150.0) -> float:
    """Seconds from `started` until the node's API answers."""
    deadline = started + timeout
    while time.monotonic() < deadline:
        assert node.process is not None and node.process.poll() is None, node.output()
        try:
            if httpx.get(f"{node.url}/v1/models", timeout=1).status_code == 200:
                return time.monotonic() - started
        except httpx.HTTPError:
            pass
        time.sleep(0.02)
    raise RuntimeError(f"{node.data_dir.name} not serving in {timeout} s:\n{node.output()}")


def launch(node: ExoProcess) -> float:
    import subprocess

    node.log_path.parent.mkdir(parents=True, exist_ok=True)
    node.log = open(node.log_path, "wb")
    started = time.monotonic()
    node.process = subprocess.Popen(node.args, stdout=node.log, stderr=subprocess.STDOUT, env=node.env)
    return started


def one_after_another(root: Path) -> list[float]:
    namespace = f"bench-{uuid.uuid4().hex[:8]}"
    nodes = [ExoProcess(root / f"seq-{n}", env(namespace)) for n in range(3)]
    try:
        return [serving_after(node, launch(node)) for node in nodes]
    finally:
        stop_all(nodes)


def all_at_once(root: Path) -> list[float]:
    namespace = f"bench-{uuid.uuid4().hex[:8]}"
    nodes = [ExoProcess(root / f"once-{n}", env(namespace)) for n in range(3)]
    try:
        starts = [launch(node) for node in nodes]
        return sorted(serving_after(node, started) for node, started in zip(nodes, starts))
    finally:
        stop_all(nodes)


async def _stream(nc: Connection, name: str, replicas: int) -> None:
    config = {"name": name, "subjects": [f"bench.{name}"], "storage": "file", "num_replicas": replicas,
              "placement": {"tags": [NODE_TAG]}, "max_msgs": 100_000}
    reply = json.loads((await nc.request(f"$JS.API.STREAM.CREATE.{name}", json.dumps(config).encode(), timeout=10)).data)
    if reply.get("error"):
        raise RuntimeError(reply["error"])


async def append_rates(url: str, appends: int, rounds: int) -> dict[int, list[float]]:
    nc = await connect([url], name="bench-appends")
    js = nc.jetstream()
    rates: dict[int, list[float]] = {3: [], 1: []}
    try:
        for replicas in (3, 1):
            await _stream(nc, f"BENCH_R{replicas}", replicas)
        for _ in range(rounds):
            for replicas in (3, 1):  # alternated: drift hits both alike
                started = time.perf_counter()
                for n in range(appends):
                    await js.publish(f"bench.BENCH_R{replicas}", b"x" * 200)
                rates[replicas].append(appends / (time.perf_counter() - started))
    finally:
        await nc.close()
    return rates


async def write_outage(url: str, kill: Callable[[str], None], duration: float = 25.0) -> tuple[float, int]:
    """The longest gap between acknowledged appends while `kill` runs; appends that failed."""
    nc = await connect([url], name="bench-outage")
    js, failed = nc.jetstream(), 0
    await _stream(nc, "BENCH_OUTAGE", 3)
    leader = json.loads((await nc.request("$JS.API.STREAM.INFO.BENCH_OUTAGE", b"{}")).data)["cluster"]["leader"]
    last_ack, longest, killed_at = time.monotonic(), 0.0, None
    end = time.monotonic() + duration
    try:
        while time.monotonic() < end:
            if killed_at is None and time.monotonic() > end - duration + 3:
                killed_at = time.monotonic()
                await asyncio.to_thread(kill, leader)
            try:
                await js.publish("bench.BENCH_OUTAGE", b"x", timeout=1)
                now = time.monotonic()
                longest, last_ack = max(longest, now - last_ack), now
            except Exception:
                failed += 1
    finally:
        await nc.close()
    return longest, failed


def outage_and_rates(root: Path, appends: int, rounds: int) -> tuple[dict[int, list[float]], tuple[float, int]]:
    namespace = f"bench-{uuid.uuid4().hex[:8]}"
    nodes = [ExoProcess(root / f"r3-{n}", env(namespace)) for n in range(3)]
    try:
        for node in nodes:
            serving_after(node, launch(node))
        time.sleep(5)  # the streams go to R3 and the witness retires
        rates = asyncio.run(append_rates(nodes[0].nats_url(), appends, rounds))
        by_name = {f"exo-{(n.data_dir / 'node_id').read_text().strip()}": n for n in nodes}

        def kill(leader: str) -> None:
            kill_9(by_name[leader])

        leader = asyncio.run(_leader_of_new_stream(nodes[0].nats_url()))
        writer = next(node for node in nodes if node is not by_name[leader])  # the writer survives the kill
        return rates, asyncio.run(write_outage(writer.nats_url(), kill))
    finally:
        stop_all(nodes)


async def _leader_of_new_stream(url: str) -> str:
    nc = await connect([url], name="bench-probe")
    try:
        await _stream(nc, "BENCH_OUTAGE", 3)
        leader: str = json.loads((await nc.request("$JS.API.STREAM.INFO.BENCH_OUTAGE", b"{}")).data)["cluster"]["leader"]
        return leader
    finally:
        await nc.close()


def summary(values: list[float], unit: str = "s", digits: int = 2) -> str:
    return (f"median {statistics.median(values):.{digits}f} {unit} "
            f"(range {min(values):.{digits}f}-{max(values):.{digits}f}, n={len(values)})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--appends", type=int, default=2000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        sequential = [one_after_another(root / f"a{r}") for r in range(args.rounds)]
        together = [all_at_once(root / f"b{r}") for r in range(args.rounds)]
        rates, outage = outage_and_rates(root / "c", args.appends, args.rounds)
    print("process start -> serving in the cluster (API answers), nodes started one after another:")
    for n in range(3):
        print(f"  node {n + 1}: {summary([run[n] for run in sequential])}")
    print("three nodes started at once (sorted by when each served):")
    for n, which in enumerate(("first", "second", "third")):
        print(f"  {which} to serve: {summary([run[n] for run in together])}")
    if outage is not None:
        print(f"write outage when the stream leader's node is killed: {outage[0]:.2f} s "
              f"(attempts refused meanwhile, each retried at once: {outage[1]})")
    r3, r1 = rates[3], rates[1]
    print(f"appends/s, one writer awaiting each ack, {args.appends} per sample:")
    print(f"  R3: {summary(r3, '/s', 0)}")
    print(f"  R1: {summary(r1, '/s', 0)}")
    print(f"  R3/R1: {statistics.median(r3) / statistics.median(r1):.2f}x")


if __name__ == "__main__":
    main()
