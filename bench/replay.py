"""How fast `exo replay` rebuilds State: events/s from the stream and from an export file.

For each size, a fresh embedded nats-server gets that many generated events (a node, a card,
an instance, then chat tasks created / started / finished, like a busy cluster's log), then,
in one run, side by side:
  read only, ordered push consumer (callback)   what exo.bus.log_reader.read_log does
  read only, pull consumer fetch(1000)          the alternative it replaces
  replay (decode + apply), ordered push consumer
  replay (decode + apply), pull fetch
  export to a JSON Lines file, replay from that file
  direct get per message (a 5,000-event sample: a million would take minutes)
  decode + apply alone, records already in memory (a 100,000-event sample): the reducer's ceiling
All replays must end in the same State, or the run fails.

    uv run python bench/replay.py [--events 100000 1000000]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from exo import event_loop  # noqa: E402
from exo.bus.connection import connect  # noqa: E402
from exo.bus.embedded import EmbeddedNats  # noqa: E402
from exo.bus.log_reader import log_bounds, read_log, read_log_fetching  # noqa: E402
from exo.bus.provision import provision  # noqa: E402
from exo.bus.subjects import EVENTS_STREAM, event_subject  # noqa: E402
from exo.core.events import (  # noqa: E402
    CustomCardAdded, Event, InstanceCreated, NodeRegistered, RunnerStatusChanged, TaskCreated, TaskFinished,
    TaskStarted, encode_event, event_tag,
)
from exo.core.types import GenerationParams, ChatMessage, Instance, ModelCard, NodeInfo, ShardAssignment, Task  # noqa: E402
from exo.tools.export_format import encode_line, read_lines  # noqa: E402
from exo.tools.replayer import Replayer  # noqa: E402

PUBLISH_BATCH = 5000
ACK_TIMEOUT_S = 30.0
GET_SAMPLE = 5000
REDUCER_SAMPLE = 100_000


def generated_events(count: int):
    """`count` events of a plausible cluster log: setup, then chat tasks in three steps each."""
    model = "bench/model"
    params = GenerationParams(messages=[ChatMessage(role="user", content="Tell me about the sea.")], max_tokens=64)
    setup: list[Event] = [
        NodeRegistered(node=NodeInfo(node_id="node-1", hostname="bench", memory_total=64 << 30, cpu_count=8)),
        CustomCardAdded(command_id="card-1", card=ModelCard(model_id=model, n_layers=24, hidden_size=1024)),
        InstanceCreated(command_id="place-1", instance=Instance(
            instance_id="inst-1", model_id=model, shards=[ShardAssignment(runner_id="run-1", node_id="node-1",
                                                                          end_layer=24)])),
        RunnerStatusChanged(runner_id="run-1", instance_id="inst-1", node_id="node-1", status="ready"),
    ]
    yield from setup[:count]
    for n in range(count - len(setup)):
        task_id, step = f"task-{n // 3:08d}", n % 3
        if step == 0:
            yield TaskCreated(command_id=task_id, task=Task(task_id=task_id, instance_id="inst-1", model_id=model,
                                                            params=params, created_at=1.7e9 + n))
        elif step == 1:
            yield TaskStarted(task_id=task_id)
        else:
            yield TaskFinished(task_id=task_id, status="completed", finish_reason="length", prompt_tokens=12,
                               completion_tokens=64)


async def append_all(nc, count: int) -> float:
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


def show(label: str, rate: float) -> tuple[str, float]:
    print(f"  {label:<60} {rate:>10,.0f} events/s", flush=True)
    return label, rate


class Variants:
    """Each way of reading / replaying the `count` events stored on `nc`; returns events/s."""

    def __init__(self, nc, count: int, export: Path) -> None:
        self.nc, self.count, self.export = nc, count, export
        self.states: list = []  # the final State of every replay, to check they agree

    async def timed(self, label: str, run, count: int | None = None) -> tuple[str, float]:
        started = time.perf_counter()
        await run()
        return show(label, (count or self.count) / (time.perf_counter() - started))

    async def read_only(self, reader) -> None:
        seen = []
        await reader(self.nc, lambda record: seen.append(record.seq))
        assert len(seen) == self.count and seen[-1] == self.count

    async def replay(self, reader) -> None:
        replayer = Replayer()
        await reader(self.nc, replayer.feed)
        assert replayer.replayed == self.count and not replayer.skipped
        self.states.append(replayer.state)

    async def export_file(self) -> None:
        with open(self.export, "wb") as sink:
            await read_log(self.nc, lambda record: sink.write(encode_line(record)))

    async def replay_file(self) -> None:
        replayer = Replayer()
        with open(self.export, "rb") as source:
            for record in read_lines(source, self.export.name):
                replayer.feed(record)
        self.states.append(replayer.state)

    async def direct_gets(self) -> None:
        js = self.nc.jetstream()
        for seq in range(1, min(self.count, GET_SAMPLE) + 1):
            await js.get_msg(EVENTS_STREAM, seq, direct=True)

    def reducer_only(self) -> float:
        """decode + apply with the records already in memory: the reducer's own ceiling."""
        with open(self.export, "rb") as source:
            records = [record for _, record in zip(range(REDUCER_SAMPLE), read_lines(source, self.export.name))]
        replayer, started = Replayer(), time.perf_counter()
        for record in records:
            replayer.feed(record)
        return len(records) / (time.perf_counter() - started)

    async def all(self) -> list[tuple[str, float]]:
        return [
            await self.timed("read only: ordered push consumer, callback", lambda: self.read_only(read_log)),
            await self.timed("read only: pull consumer, fetch(1000)", lambda: self.read_only(read_log_fetching)),
            await self.timed("replay from stream: ordered push consumer, callback", lambda: self.replay(read_log)),
            await self.timed("replay from stream: pull consumer, fetch(1000)", lambda: self.replay(read_log_fetching)),
            await self.timed("export to JSON Lines (ordered push consumer)", self.export_file),
            await self.timed("replay from the JSON Lines file", self.replay_file),
            await self.timed(f"read only: direct get per message ({GET_SAMPLE:,} sample)", self.direct_gets,
                             min(self.count, GET_SAMPLE)),
            show(f"reducer only: decode + apply, in memory ({min(self.count, REDUCER_SAMPLE):,} sample)",
                 self.reducer_only()),
        ]


async def bench_size(count: int, workdir: Path) -> list[tuple[str, float]]:
    server = EmbeddedNats(workdir / f"nats-{count}", port=0)
    nc = await connect([await server.start()], name="bench-replay")
    try:
        await provision(nc)
        print(f"{count:,} events: appending ...", flush=True)
        rows = [show("append (core publish, flush every 5,000)", await append_all(nc, count))]
        variants = Variants(nc, count, workdir / f"events-{count}.jsonl")
        rows += await variants.all()
        states = variants.states
        assert all(state == states[0] for state in states), "replays disagree"
        print(f"  all {len(states)} replays end in the same State (sequence {states[0].last_seq})", flush=True)
        return rows
    finally:
        await nc.close()
        server.stop()


async def main(sizes: list[int]) -> None:
    with tempfile.TemporaryDirectory(prefix="exo-bench-replay-") as tmp:
        results = {count: await bench_size(count, Path(tmp)) for count in sizes}
    print("\n| what | " + " | ".join(f"{c:,} events" for c in sizes) + " |")
    print("|---|" + "---|" * len(sizes))
    for index, (label, _) in enumerate(results[sizes[0]]):
        print(f"| {label} | " + " | ".join(f"{results[c][index][1]:,.0f}/s" for c in sizes) + " |")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, nargs="+", default=[100_000, 1_000_000])
    event_loop.run(main(parser.parse_args().events))
