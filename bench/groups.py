"""Master groups at scale (issue #34, part 2): the simulator of bench/scale.py (a real nats-server,
real master and API processes, N simulated nodes running the real worker code) with G master
groups, each led by a master process of its own (EXO_LEAD_GROUPS), the requests spread evenly over
G models, one per group. G = 0 is today's single master, for comparison.

Per G it prints, per offered rate: requests answered, p50/p99 of the control plane, and the CPU of
every master, of the API, the simulated nodes and nats-server. Then the CPU per request of each
group's master (its CPU over its own requests), and what a core per master would carry. Last, a
late joiner's catch-up: the shared log alone, then with 1, 2, ... G group logs.

    uv run python -m bench.groups [--nodes 1000] [--groups 0 1 2 4] [--rates 100 200 300] [--seconds 8]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from bench.scale import cpu_seconds, one_request, pct, pid_of, place_instances
from exo.bus.catch_up import catch_up
from exo.bus.connection import connect
from exo.bus.subjects import group_names
from tests.support.cluster import NatsServer, start_node
from tests.support.exo_process import ExoProcess
from tests.support.simulator import SimulatorProcess, fake_model_dir


def models_for(groups: int) -> list[str]:
    return [f"sim/fake-{n}" for n in range(max(groups, 1))]


def group_map(groups: int) -> str:
    return ",".join(f"g{n}={model}" for n, model in enumerate(models_for(groups))) if groups else ""


async def drive(url: str, models: list[str], rate: float, seconds: float, delay_s: float,
                pids: dict[str, int]) -> dict[str, Any]:
    """Open loop at `rate`, request i for model i % len(models)."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=2048),
                                     timeout=aiohttp.ClientTimeout(total=60)) as http:
        before = {name: cpu_seconds(pid) for name, pid in pids.items()}
        started, pending = time.perf_counter(), []
        for n in range(int(rate * seconds)):
            if (wait := started + n / rate - time.perf_counter()) > 0:
                await asyncio.sleep(wait)
            pending.append(asyncio.create_task(one_request(http, url, n, delay_s, models[n % len(models)])))
        results = await asyncio.gather(*pending)
        wall = time.perf_counter() - started
        cpu = {name: (cpu_seconds(pid) - before[name]) / wall * 100 for name, pid in pids.items()}
    latencies = [r * 1000 for r in results if r is not None]
    per_model = [sum(1 for n, r in enumerate(results) if r is not None and n % len(models) == m)
                 for m in range(len(models))]
    return {"rate": rate, "sent": len(results), "answered": len(latencies), "achieved": len(latencies) / wall,
            "p50": pct(latencies, 0.5), "p99": pct(latencies, 0.99), "cpu": cpu, "per_model": per_model, "wall": wall}


def start_masters(root: Path, nats_url: str, groups: int, groups_only: bool) -> list[ExoProcess]:
    """One master process per group (the first also leads the shared log); G = 0: one master, no groups."""
    env = {"EXO_MASTER_GROUPS": group_map(groups)}
    masters = []
    for n in range(max(groups, 1)):
        lead = {"EXO_LEAD_GROUPS": f"g{n}"} if groups else {}
        if groups and n > 0 and groups_only:  # groups only: no shared lease, no pulses
            lead["EXO_LEAD_SHARED"] = "0"
        masters.append(start_node(root, f"master{n}", nats_url, "--no-worker", "--no-api", env=env | lead))
        if n == 0:  # it leads the shared log: the others stand by for it
            time.sleep(2)
    return masters


async def catch_up_times(nats_url: str, groups: int) -> list[float]:
    """ms for a late joiner to catch up the shared log, then each group's log in turn (cumulative)."""
    nc = await connect([nats_url], name="bench-late-joiner")
    times, views, started = [], [], time.perf_counter()
    try:
        views.append((await catch_up(nc))[0])
        times.append((time.perf_counter() - started) * 1000)
        for n in range(groups):
            views.append((await catch_up(nc, names=group_names(f"g{n}")))[0])
            times.append((time.perf_counter() - started) * 1000)
    finally:
        for view in views:
            await view.stop()
        await nc.close()
    return times


async def measure(args: argparse.Namespace, groups: int, root: Path, nats: NatsServer) -> None:
    models = models_for(groups)
    masters = start_masters(root, nats.url, groups, args.groups_only)
    api = start_node(root, "api", nats.url, "--no-worker", "--no-master")
    simulator = SimulatorProcess(nats.url, args.nodes, root / "sim", root / "sim.log", delay_ms=args.delay_ms)
    try:
        simulator.wait_ready(900)
        await asyncio.to_thread(place_instances, api.url, min(args.instances, args.nodes), fake_model_dir(root / "fake"),
                                api, tuple(models))
        pids = {f"master{n}": pid_of(m.process) for n, m in enumerate(masters)}
        pids |= {"API": pid_of(api.process), "simulated nodes": simulator.process.pid, "nats-server": pid_of(nats.server.process),
                 "load generator": os.getpid()}
        for rate in args.rates:
            step = await drive(api.url, models, rate, args.seconds, args.delay_ms / 1000, pids)
            report(groups, step)
            if step["answered"] < step["sent"] * 0.99:
                break
        times = await catch_up_times(nats.url, groups)
        print(f"  catch-up: shared log {times[0]:.0f} ms" + "".join(
            f", +{n + 1} group(s) {t:.0f} ms" for n, t in enumerate(times[1:])), flush=True)
    finally:
        simulator.stop()
        api.interrupt()
        for master in masters:
            master.interrupt()


def report(groups: int, step: dict[str, Any]) -> None:
    cpu = step["cpu"]
    print(f"  G={groups} {step['rate']:>5.0f}/s offered: {step['achieved']:.0f} answered/s, p50 {step['p50']:.1f} ms, "
          f"p99 {step['p99']:.1f} ms; CPU " + ", ".join(f"{k} {v:.0f}%" for k, v in cpu.items()), flush=True)
    per_request = []
    for n, answered in enumerate(step["per_model"]):
        if answered:
            per_request.append(cpu[f"master{n}"] / 100 * step["wall"] / answered * 1000)
    if per_request:
        each = statistics.median(per_request)
        print(f"      master CPU per request of its own group: median {each:.2f} ms "
              f"({', '.join(f'{v:.2f}' for v in per_request)}); a core per master carries ~{1000 / each:.0f} req/s, "
              f"{max(groups, 1)} such masters ~{max(groups, 1) * 1000 / each:.0f} req/s", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--instances", type=int, default=100)
    parser.add_argument("--groups", type=int, nargs="+", default=[0, 1, 2, 4])
    parser.add_argument("--rates", type=float, nargs="+", default=[100, 200, 300])
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--delay-ms", type=float, default=5.0)
    parser.add_argument("--groups-only", action="store_true",
                        help="masters after the first lead their group only (EXO_LEAD_SHARED=0): no pulses heard")
    args = parser.parse_args()
    print(f"{os.cpu_count()} cores; {args.nodes} simulated nodes, {args.instances} instances", flush=True)
    with tempfile.TemporaryDirectory(prefix="exo-groups-") as tmp:
        for run, groups in enumerate(args.groups):
            root = Path(tmp) / f"run{run}-g{groups}"
            nats = NatsServer(root / "nats")
            try:
                asyncio.run(measure(args, groups, root, nats))
            finally:
                nats.stop()


if __name__ == "__main__":
    main()
