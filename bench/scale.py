"""The control plane at scale: a real nats-server, master and API (each its own process), and N
simulated nodes that are the real worker code with a fake runner at its edge
(tests/support/simulated_nodes.py: each request is answered with --chunks chunks after
--delay-ms). An open-loop load generator drives requests/s through the API at rising rates.

Per N, it prints: control-plane latency (client send -> first chunk, less the fake runner's delay)
p50/p99 per rate and the highest rate sustained with p99 <= 100 ms, the CPU of every process, events/s
in the log by kind under load and idle, State size and snapshot write time, a new node's
catch-up time, the followers' lag, and the API node's memory.

    uv run python -m bench.scale [--nodes 10 100 1000] [--instances 100] [--rates 50 100 200 400] [--seconds 6]
    uv run python -m bench.scale --quick   # the regression guard: CPU per request of each process
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import subprocess
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any, TypedDict

import aiohttp
import httpx
from nats.aio.msg import Msg

from exo.bus.catch_up import catch_up
from exo.bus.connection import connect
from exo.bus.event_log import EventLog
from exo.bus.subjects import ALL_EVENTS
from exo.core.state import encode_state
from tests.support.cluster import NatsServer, start_node, state_of
from tests.support.exo_process import ExoProcess
from tests.support.simulated_nodes import SEQ_PROBE
from tests.support.simulator import FAKE_MODEL, SimulatorProcess, fake_model_dir

TICK = os.sysconf("SC_CLK_TCK")


class Step(TypedDict):
    """One offered rate: requests sent and answered, rates (/s), latency percentiles (ms), CPU % by process."""

    rate: float
    sent: int
    answered: int
    achieved: float
    send_rate: float
    p50: float
    p99: float
    cpu: dict[str, float]
    events_per_s: dict[str, float]


class StateSummary(TypedDict):
    """A late joiner's catch-up and the size of State (`measure_state`)."""

    catch_up_ms: float
    from_snapshot_at: int
    last_seq: int
    state_bytes: int
    encode_ms: float
    tasks: int


class SizeResult(TypedDict):
    """Everything measured for one N (what --json writes, one per N)."""

    nodes: int
    instances: int
    steps: list[Step]
    idle_events_per_s: dict[str, float]
    idle_cpu: dict[str, float]
    state: StateSummary
    snapshots_ms: list[float]
    api_rss_mib: float
    lag: dict[str, list[int]]


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK  # utime + stime


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def pid_of(process: subprocess.Popen[Any] | None) -> int:
    assert process is not None, "not started"
    return process.pid


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


class Probe:
    """Events by kind (a core subscription on the event subjects) and the followers' lag."""

    def __init__(self, nats_url: str, api_url: str) -> None:
        self.nats_url, self.api_url = nats_url, api_url
        self.kinds: Counter[str] = Counter()
        self.lag: dict[str, list[int]] = {"simulated nodes": [], "API": []}

    async def start(self) -> None:
        self.nc = await connect([self.nats_url], name="bench-probe")
        self.log = EventLog(self.nc)

        async def count(msg: Msg) -> None:
            self.kinds[msg.subject.removeprefix("exo.events.")] += 1

        await self.nc.subscribe(ALL_EVENTS, cb=count)

    async def sample_lag(self, http: aiohttp.ClientSession) -> None:
        last = await self.log.last_sequence()
        simulated = int((await self.nc.request(SEQ_PROBE, b"", timeout=5)).data)
        async with http.get(f"{self.api_url}/health") as response:
            api = (await response.json())["last_seq"]
        self.lag["simulated nodes"].append(max(0, last - simulated))
        self.lag["API"].append(max(0, last - api))


def _has_content(line: bytes) -> bool:
    choices = json.loads(line[6:]).get("choices") or [{}]
    return bool(choices[0].get("delta", {}).get("content"))


async def one_request(http: aiohttp.ClientSession, url: str, n: int, delay_s: float,
                      model: str = FAKE_MODEL) -> float | None:
    """Control-plane latency of one streamed request (seconds), or None if it failed."""
    body = {"model": model, "messages": [{"role": "user", "content": f"request {n}"}], "max_tokens": 8,
            "stream": True}
    sent = time.perf_counter()
    first = None
    try:
        async with http.post(f"{url}/v1/chat/completions", json=body) as response:
            if response.status != 200:
                return None
            async for line in response.content:
                if first is None and line.startswith(b"data: {") and _has_content(line):
                    first = time.perf_counter()
    except (TimeoutError, aiohttp.ClientError):
        return None
    return None if first is None else first - sent - delay_s


async def drive(url: str, rate: float, seconds: float, delay_s: float, probe: Probe, pids: dict[str, int]) -> Step:
    """Open loop: request i is sent at start + i/rate, whether or not earlier ones have answered."""
    connector = aiohttp.TCPConnector(limit=2048)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=60)) as http:
        cpu_before = {name: cpu_seconds(pid) for name, pid in pids.items()}
        kinds_before = Counter(probe.kinds)
        started = time.perf_counter()
        pending: list[asyncio.Task[float | None]] = []
        total = int(rate * seconds)
        next_lag = started
        for n in range(total):
            wait = started + n / rate - time.perf_counter()
            if wait > 0:
                await asyncio.sleep(wait)
            pending.append(asyncio.create_task(one_request(http, url, n, delay_s)))
            if time.perf_counter() >= next_lag:
                next_lag += 0.5
                asyncio.create_task(probe.sample_lag(http))
        sending = time.perf_counter() - started
        results = await asyncio.gather(*pending)
        wall = time.perf_counter() - started
        cpu = {name: (cpu_seconds(pid) - cpu_before[name]) / wall * 100 for name, pid in pids.items()}
    latencies = [r * 1000 for r in results if r is not None]
    events = probe.kinds - kinds_before
    return Step(rate=rate, sent=total, answered=len(latencies), achieved=len(latencies) / wall,
                send_rate=total / sending, p50=pct(latencies, 0.5), p99=pct(latencies, 0.99),
                cpu=cpu, events_per_s={k: v / wall for k, v in events.most_common()})


def place_instances(api_url: str, count: int, model_dir: Path, head: ExoProcess,
                    models: tuple[str, ...] = (FAKE_MODEL,)) -> None:
    """`count` instances, spread in turn over `models` (each a card of `model_dir`), once all are ready."""
    http = httpx.Client(base_url=api_url, timeout=120)
    for model in models:
        added = http.post("/models/add", json={"model_id": model, "path": str(model_dir)})
        assert added.status_code == 200, added.text
    for n in range(count):
        placed = http.post("/place_instance", json={"model_id": models[n % len(models)]})
        assert placed.status_code == 200, placed.text
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        runners = state_of(head).runners.values()
        if len(runners) == count and all(r.status == "ready" for r in runners):
            return
        time.sleep(0.5)
    raise RuntimeError("the instances did not become ready")


async def measure_state(nats_url: str) -> StateSummary:
    """A new node's catch-up (latest snapshot + the log's tail), and the size of State."""
    nc = await connect([nats_url], name="bench-late-joiner")
    started = time.perf_counter()
    view, from_seq = await catch_up(nc)
    caught_up = time.perf_counter() - started
    started = time.perf_counter()
    payload = encode_state(view.state)
    encoded = time.perf_counter() - started
    await view.stop()
    await nc.close()
    return StateSummary(catch_up_ms=caught_up * 1000, from_snapshot_at=from_seq, last_seq=view.state.last_seq,
                        state_bytes=len(payload), encode_ms=encoded * 1000, tasks=len(view.state.tasks))


def snapshot_times(master_log: str) -> list[float]:
    return [float(ms) for ms in re.findall(r"snapshot at sequence \d+ \((\d+) ms\)", master_log)]


def run_size(args: argparse.Namespace, nodes: int, root: Path) -> SizeResult:
    nats = NatsServer(root / "nats")  # its own event loop: before ours
    try:
        return asyncio.run(measure_size(args, nodes, root, nats))
    finally:
        nats.stop()


async def measure_size(args: argparse.Namespace, nodes: int, root: Path, nats: NatsServer) -> SizeResult:
    instances = min(args.instances, nodes)
    master = start_node(root, "master", nats.url, "--no-worker", "--no-api")
    api = start_node(root, "api", nats.url, "--no-worker", "--no-master")
    simulator = SimulatorProcess(nats.url, nodes, root / "sim", root / "sim.log", delay_ms=args.delay_ms)
    try:
        started = time.perf_counter()
        simulator.wait_ready(900)
        print(f"  {nodes} simulated nodes registered in {time.perf_counter() - started:.1f} s", flush=True)
        await asyncio.to_thread(place_instances, api.url, instances, fake_model_dir(root / "fake"), api)
        pids = {"master": pid_of(master.process), "API": pid_of(api.process), "simulated nodes": simulator.process.pid,
                "nats-server": pid_of(nats.server.process), "load generator": os.getpid()}
        probe = Probe(nats.url, api.url)
        await probe.start()
        steps: list[Step] = []
        for rate in args.rates:
            step = await drive(api.url, rate, args.seconds, args.delay_ms / 1000, probe, pids)
            steps.append(step)
            print(f"  {rate:>6.0f} req/s offered: {step['achieved']:.0f} answered/s, p50 {step['p50']:.1f} ms, "
                  f"p99 {step['p99']:.1f} ms, CPU " + ", ".join(f"{k} {v:.0f}%" for k, v in step["cpu"].items()),
                  flush=True)
            if step["answered"] < step["sent"] * 0.99 or step["p99"] > 1000:
                break  # saturated: higher rates only queue
        idle_before, idle_cpu = Counter(probe.kinds), {name: cpu_seconds(pid) for name, pid in pids.items()}
        await asyncio.sleep(args.idle)
        idle = {k: v / args.idle for k, v in (probe.kinds - idle_before).items()}
        idle_cpu_pct = {name: (cpu_seconds(pid) - idle_cpu[name]) / args.idle * 100 for name, pid in pids.items()}
        state = await measure_state(nats.url)
        await probe.nc.close()
        return SizeResult(nodes=nodes, instances=instances, steps=steps, idle_events_per_s=idle,
                          idle_cpu=idle_cpu_pct, state=state, snapshots_ms=snapshot_times(master.output()),
                          api_rss_mib=rss_mib(pid_of(api.process)), lag=probe.lag)
    finally:
        simulator.stop()
        api.interrupt()
        master.interrupt()


def report(result: SizeResult) -> None:
    steps = result["steps"]
    good = [s for s in steps if s["p99"] <= 100 and s["answered"] >= s["sent"] * 0.99]
    sustained = max((s["achieved"] for s in good), default=0.0)
    print(f"\nN = {result['nodes']} nodes, {result['instances']} instances")
    print(f"  {'offered/s':>9} {'answered/s':>10} {'p50 ms':>7} {'p99 ms':>7}  events/s by kind")
    for s in steps:
        kinds = ", ".join(f"{k} {v:.0f}" for k, v in s["events_per_s"].items())
        print(f"  {s['rate']:>9.0f} {s['achieved']:>10.0f} {s['p50']:>7.1f} {s['p99']:>7.1f}  {kinds}")
    print(f"  sustained with p99 <= 100 ms: {sustained:.0f} req/s")
    last = steps[-1]
    print("  CPU at the highest rate: " + ", ".join(f"{k} {v:.0f}%" for k, v in last["cpu"].items()))
    busiest = max(steps, key=lambda s: s["achieved"])
    per_request = {k: v / 100 / busiest["achieved"] * 1000 for k, v in busiest["cpu"].items()}
    print("  CPU per request (ms): " + ", ".join(f"{k} {v:.2f}" for k, v in per_request.items())
          + f"; sum {sum(per_request.values()):.2f}"
          + f"; one core each would cap the master at {1000 / per_request['master']:.0f} req/s")
    # The same less what each process spends idle (1,000 nodes' pulses cost the simulated nodes and
    # the master CPU with no request at all): what a request itself costs.
    idle_cpu = result["idle_cpu"]
    net = {k: max(0.0, v - idle_cpu.get(k, 0.0)) / 100 / busiest["achieved"] * 1000 for k, v in busiest["cpu"].items()}
    print("  CPU per request net of idle (ms): " + ", ".join(f"{k} {v:.2f}" for k, v in net.items())
          + f"; sum {sum(net.values()):.2f}")
    total = sum(busiest["cpu"].values())
    cores = os.cpu_count() or 1
    if total >= 85 * cores:
        print(f"  first bottleneck: this machine's {cores} cores ({total:.0f}% CPU in all, every process busy)")
    else:
        name, share = max(busiest["cpu"].items(), key=lambda kv: kv[1])
        print(f"  first bottleneck: the {name} process ({share:.0f}% of one core; {total:.0f}% in all)")
    idle = result["idle_events_per_s"]
    print(f"  idle: {sum(idle.values()):.2f} events/s ({', '.join(f'{k} {v:.2f}' for k, v in idle.items()) or 'none'}); "
          "CPU " + ", ".join(f"{k} {v:.1f}%" for k, v in result["idle_cpu"].items()))
    state = result["state"]
    snaps = result["snapshots_ms"]
    print(f"  State: {state['state_bytes'] / 1024:.0f} KiB ({state['tasks']} tasks kept), encoded in "
          f"{state['encode_ms']:.1f} ms; snapshots written: {len(snaps)}, "
          f"median {statistics.median(snaps) if snaps else float('nan'):.0f} ms, max {max(snaps, default=float('nan')):.0f} ms")
    print(f"  new node catch-up: {state['catch_up_ms']:.0f} ms (snapshot at {state['from_snapshot_at']}, "
          f"log at {state['last_seq']})")
    for who, lags in result["lag"].items():
        print(f"  follower lag, {who}: median {statistics.median(lags) if lags else 0:.0f}, max {max(lags, default=0)} events "
              f"({len(lags)} samples)")
    print(f"  API node memory: {result['api_rss_mib']:.0f} MiB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, nargs="+", default=[10, 100, 1000])
    parser.add_argument("--instances", type=int, default=100, help="at most one per node")
    parser.add_argument("--rates", type=float, nargs="+", default=[50, 100, 200, 400, 800, 1600])
    parser.add_argument("--seconds", type=float, default=6.0, help="per rate")
    parser.add_argument("--idle", type=float, default=20.0, help="seconds of idle measured after the load")
    parser.add_argument("--delay-ms", type=float, default=5.0, help="the fake runner's time per request")
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--quick", action="store_true",
                        help="the regression guard (about a minute): 1,000 nodes, 200 and 300 req/s for 8 s each, 5 s idle")
    args = parser.parse_args()
    if args.quick:
        args.nodes, args.rates, args.seconds, args.idle = [1000], [200, 300], 8.0, 5.0
    results: list[SizeResult] = []
    with tempfile.TemporaryDirectory(prefix="exo-scale-") as tmp:
        for nodes in args.nodes:
            print(f"N = {nodes}: starting", flush=True)
            results.append(run_size(args, nodes, Path(tmp) / f"n{nodes}"))
            report(results[-1])
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
