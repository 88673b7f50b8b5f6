"""How fast `exo replay` rebuilds State: events/s from the stream and from an export file.

For each size, a fresh embedded nats-server gets that many generated events (a node, a card,
an instance, then chat tasks created / started / finished, like a busy cluster's log), then
every variant runs `--runs` times (median reported, with the range and this process's CPU
time per event, which says more than wall time on a shared machine):
  read only: raw reader                          what exo.bus.tooling.log_reader.read_log does now
  read only: nats-py ordered push consumer       what it did before (read_log_ordered)
  read only: pull consumer fetch(1000)
  replay from stream: raw reader + batch fold    `exo replay`
  replay from stream: ordered consumer, one apply per event   (before)
  export to JSON Lines, replay from that file (batch fold)
  direct get per message (a 5,000-event sample: a million would take minutes)
  decode + apply alone, records already in memory (a 100,000-event sample), batch fold and
  one apply per event: the reducer's ceiling
All replays must end in the same State, or the run fails.

    uv run python -m bench.replay [--events 100000 1000000] [--runs 3]
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

from exo import event_loop
from exo.bus.connection import Connection, connect
from exo.bus.provision import provision
from exo.bus.server.embedded import EmbeddedNats
from exo.bus.subjects import EVENTS_STREAM, event_subject
from exo.bus.tooling.log_reader import log_bounds, read_log, read_log_batches, read_log_fetching, read_log_ordered
from exo.bus.tooling.log_records import LogRecord, OnBatch
from exo.bus.tooling.raw_reader import SIGNED
from exo.core.events import (
    CustomCardAdded,
    Event,
    InstanceCreated,
    LeaderElected,
    NodeRegistered,
    RunnerStatusChanged,
    TaskCreated,
    TaskFinished,
    TaskStarted,
    encode_event,
    event_tag,
)
from exo.core.ids import CommandId, InstanceId, ModelId, NodeId, RunnerId, TaskId
from exo.core.requests import ChatMessage, GenerationParams
from exo.core.state import State
from exo.core.types import Instance, ModelCard, NodeInfo, ShardAssignment, Task
from exo.tools.export_format import encode_line, read_lines
from exo.tools.replay import BatchReplayer, _fold_file
from exo.tools.replay_fold import Replayer

PUBLISH_BATCH = 5000
ACK_TIMEOUT_S = 30  # whole seconds: nats-py's flush takes an int
GET_SAMPLE = 5000
REDUCER_SAMPLE = 100_000

Variant = Callable[[], Awaitable[None]]


def generated_events(count: int) -> Iterator[Event]:
    """`count` events of a plausible cluster log: setup, then chat tasks in three steps each."""
    model, node, instance, runner = ModelId("bench/model"), NodeId("node-1"), InstanceId("inst-1"), RunnerId("run-1")
    params = GenerationParams(messages=[ChatMessage(role="user", content="Tell me about the sea.")], max_tokens=64)
    setup: list[Event] = [  # the master's events carry the term of the election at sequence 1
        LeaderElected(node_id=node, lease_revision=1),
        NodeRegistered(node=NodeInfo(node_id=node, hostname="bench", memory_total=64 << 30, cpu_count=8)),
        CustomCardAdded(command_id=CommandId("card-1"), term=1, card=ModelCard(model_id=model, n_layers=24, hidden_size=1024)),
        InstanceCreated(command_id=CommandId("place-1"), term=1, instance=Instance(
            instance_id=instance, model_id=model, shards=[ShardAssignment(runner_id=runner, node_id=node, end_layer=24)])),
        RunnerStatusChanged(runner_id=runner, instance_id=instance, node_id=node, status="ready"),
    ]
    yield from setup[:count]
    for n in range(count - len(setup)):
        task_id, step = TaskId(f"task-{n // 3:08d}"), n % 3
        if step == 0:
            yield TaskCreated(command_id=task_id, term=1, task=Task(task_id=task_id, instance_id=instance, model_id=model,
                                                            params=params, created_at=1.7e9 + n))
        elif step == 1:
            yield TaskStarted(task_id=task_id)
        else:
            yield TaskFinished(task_id=task_id, status="completed", finish_reason="length", prompt_tokens=12,
                               completion_tokens=64)


async def append_all(nc: Connection, count: int) -> float:
    """Core publishes (no ack each) in flushed batches: many times faster than waiting for acks.
    The stream must end up holding exactly `count` events, or the run fails: a server that
    dropped some under load is caught, not measured."""
    started = time.perf_counter()
    for n, event in enumerate(generated_events(count)):
        await nc.publish(event_subject(event_tag(event)), encode_event(event), headers={"Nats-Msg-Id": f"bench-{n}"})
        if n % PUBLISH_BATCH == PUBLISH_BATCH - 1:
            await nc.flush(timeout=ACK_TIMEOUT_S)
    await nc.flush(timeout=ACK_TIMEOUT_S)
    deadline = time.monotonic() + ACK_TIMEOUT_S
    while (stored := (await log_bounds(nc)).last_seq) < count and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    elapsed = time.perf_counter() - started
    assert stored == count, f"appended {count} events, the stream has {stored}"
    return count / elapsed


class Variants:
    """Each way of reading / replaying the `count` events stored on `nc`."""

    def __init__(self, nc: Connection, count: int, export: Path) -> None:
        self.nc, self.count, self.export = nc, count, export
        self.states: list[State] = []  # the final State of every replay, to check they agree

    async def read_only(self, reader: Callable[[Connection, OnBatch], Awaitable[int]]) -> None:
        seen: list[tuple[int, int]] = []
        await reader(self.nc, lambda batch: seen.append((len(batch), batch[-1].seq)))
        assert sum(size for size, _ in seen) == self.count and seen[-1][1] == self.count

    async def read_only_fetching(self) -> None:
        seen: list[int] = []
        await read_log_fetching(self.nc, lambda record: seen.append(record.seq))
        assert len(seen) == self.count and seen[-1] == self.count

    async def replay_batched(self) -> None:
        """What `exo replay` does: the raw reader, signed records' headers only, a batch fold per socket read."""
        replayer = BatchReplayer()
        await read_log_batches(self.nc, replayer.feed_all, headers=SIGNED)
        self.check(replayer)

    async def replay_per_event(self) -> None:
        """What it did before: nats-py's ordered consumer, one `apply` (a new State) per event."""
        replayer = Replayer()

        def feed(batch: list[LogRecord]) -> None:
            for record in batch:
                replayer.feed(record)

        await read_log_ordered(self.nc, feed)
        self.check(replayer)

    def check(self, replayer: Replayer) -> None:
        assert replayer.replayed == self.count and not replayer.skipped
        self.states.append(replayer.state)

    async def export_file(self) -> None:
        with open(self.export, "wb") as sink:

            def write(record: LogRecord) -> None:
                sink.write(encode_line(record))

            await read_log(self.nc, write)

    async def replay_file(self) -> None:
        replayer = BatchReplayer()
        _fold_file(str(self.export), replayer, None)
        self.check(replayer)

    async def direct_gets(self) -> None:
        js = self.nc.jetstream()
        for seq in range(1, min(self.count, GET_SAMPLE) + 1):
            await js.get_msg(EVENTS_STREAM, seq, direct=True)

    def in_memory(self) -> list[LogRecord]:
        with open(self.export, "rb") as source:
            return [record for _, record in zip(range(REDUCER_SAMPLE), read_lines(source, self.export.name))]

    async def reducer_batched(self, records: list[LogRecord]) -> None:
        replayer = BatchReplayer()
        for start in range(0, len(records), 100):  # about what one socket read holds
            replayer.feed_all(records[start:start + 100])

    async def reducer_per_event(self, records: list[LogRecord]) -> None:
        replayer = Replayer()
        for record in records:
            replayer.feed(record)

    def plan(self) -> list[tuple[str, Variant | str, int]]:
        """(label, coroutine function or "batched" / "per event" (the reducer alone, on records read
        beforehand), events it handles), in the order they run."""
        sample = min(self.count, REDUCER_SAMPLE)
        return [
            ("read only: raw reader (`read_log`, now)", lambda: self.read_only(read_log_batches), self.count),
            ("read only: nats-py ordered push consumer (before)", lambda: self.read_only(read_log_ordered), self.count),
            ("read only: pull consumer, fetch(1000)", self.read_only_fetching, self.count),
            ("replay from stream: raw reader + batch fold (`exo replay`)", self.replay_batched, self.count),
            ("replay from stream: ordered consumer, apply per event (before)", self.replay_per_event, self.count),
            ("export to JSON Lines (`exo events export`)", self.export_file, self.count),
            ("replay from the JSON Lines file, batch fold (`exo replay --file`)", self.replay_file, self.count),
            (f"read only: direct get per message ({GET_SAMPLE:,} sample)", self.direct_gets, min(self.count, GET_SAMPLE)),
            (f"reducer only: decode + batch fold, in memory ({sample:,} sample)", "batched", sample),
            (f"reducer only: decode + apply per event, in memory ({sample:,} sample)", "per event", sample),
        ]

    async def run_all(self, runs: int) -> list[tuple[str, list[float], list[float]]]:
        """Per variant: events/s and CPU µs per event of each run."""
        results: dict[str, tuple[list[float], list[float]]] = {}
        plan = self.plan()
        for run in range(runs):
            for label, variant, count in plan:
                call: Variant
                if isinstance(variant, str):  # "batched" or "per event"
                    records = self.in_memory()
                    body = self.reducer_batched if variant == "batched" else self.reducer_per_event
                    call = functools.partial(body, records)
                else:
                    call = variant
                wall, cpu = time.perf_counter(), time.process_time()
                await call()
                wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
                rates, cpus = results.setdefault(label, ([], []))
                rates.append(count / wall)
                cpus.append(cpu / count * 1e6)
                print(f"  run {run + 1}: {label:<72} {count / wall:>10,.0f} events/s  {cpu / count * 1e6:6.1f} µs CPU/event",
                      flush=True)
        return [(label, *results[label]) for label, _, _ in plan]


async def bench_size(count: int, workdir: Path, runs: int) -> list[tuple[str, list[float], list[float]]]:
    server = EmbeddedNats(workdir / f"nats-{count}", port=0)
    nc = await connect([await server.start()], name="bench-replay")
    try:
        await provision(nc)
        print(f"{count:,} events: appending ...", flush=True)
        append_rate = await append_all(nc, count)
        print(f"  append (core publish, flush every 5,000): {append_rate:,.0f} events/s", flush=True)
        variants = Variants(nc, count, workdir / f"events-{count}.jsonl")
        rows = await variants.run_all(runs)
        states = variants.states
        assert all(state == states[0] for state in states), "replays disagree"
        print(f"  all {len(states)} replays end in the same State (sequence {states[0].last_seq})", flush=True)
        return [("append (core publish, flush every 5,000; count checked)", [append_rate], [])] + rows
    finally:
        await nc.close()
        server.stop()


def cell(rates: list[float], cpus: list[float]) -> str:
    text = f"{statistics.median(rates):,.0f}/s"
    if len(rates) > 1:
        text += f" ({min(rates) / 1000:,.0f}k-{max(rates) / 1000:,.0f}k)"
    if cpus:
        text += f", {statistics.median(cpus):.1f} µs"
    return text


async def main(sizes: list[int], runs: int) -> None:
    with tempfile.TemporaryDirectory(prefix="exo-bench-replay-") as tmp:
        results = {count: await bench_size(count, Path(tmp), runs) for count in sizes}
    print(f"\nmedian of {runs} runs (range), and this process's CPU time per event")
    print("\n| what | " + " | ".join(f"{c:,} events" for c in sizes) + " |")
    print("|---|" + "---|" * len(sizes))
    for index, (label, _, _) in enumerate(results[sizes[0]]):
        print(f"| {label} | " + " | ".join(cell(*results[c][index][1:]) for c in sizes) + " |")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, nargs="+", default=[100_000, 1_000_000])
    parser.add_argument("--runs", type=int, default=3, help="runs of every variant per size (median reported)")
    args = parser.parse_args()
    event_loop.run(main(args.events, args.runs))
