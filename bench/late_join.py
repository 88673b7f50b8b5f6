"""How long a joining node takes to be ready to plan, with a snapshot and with a replay from
sequence 1, against logs of 10k, 100k and 1M events; and image transfer through the object
store. One run, side by side, with ratios.

    uv run python -m bench.late_join [--sizes 10000,100000,1000000] [--image-mb 10] [--elections 1]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time
from pathlib import Path

from exo.bus.catch_up import catch_up
from exo.bus.chunk_signing import ChunkSigner
from exo.bus.connection import Connection, connect
from exo.bus.event_log import EventLog
from exo.bus.images import fetch_image, store_image
from exo.bus.provision import provision
from exo.bus.server.embedded import EmbeddedNats
from exo.bus.server.node_keys import load_node_key
from exo.bus.snapshots import write_snapshot
from exo.bus.subjects import IMAGES_BUCKET, event_subject
from exo.core.events import Event, LeaderElected, NodeRegistered, TaskCreated, TaskFinished, TaskStarted, encode_event, event_tag
from exo.core.ids import InstanceId, ModelId, NodeId, TaskId
from exo.core.requests import GenerationParams
from exo.core.state import State, encode_state
from exo.core.types import NodeInfo, Task

TAIL = 500  # events after the snapshot, as between two snapshots of a busy master


def history_event(n: int, term: int = 1) -> Event:
    """A busy cluster's steady state: every task is created, started and finished, and nodes
    report in between; State stays bounded (1,000 finished tasks are kept)."""
    match n % 4:
        case 0:
            params = GenerationParams(max_tokens=n)
            task = Task(task_id=TaskId(f"t{n}"), instance_id=InstanceId("i"), model_id=ModelId("m"), params=params)
            return TaskCreated(task=task, term=term)
        case 1:
            return TaskStarted(task_id=TaskId(f"t{n - 1}"))
        case 2:
            return TaskFinished(task_id=TaskId(f"t{n - 2}"), status="completed", completion_tokens=n)
        case _:
            return NodeRegistered(node=NodeInfo(node_id=NodeId(f"node-{n % 7}"), memory_available=n))


async def append_history(nc: Connection, start: int, stop: int, term: int = 1) -> None:
    """Core publishes into the stream (no ack per event), then one flush: the fastest way in."""
    for n in range(start, stop):
        event = history_event(n, term)
        await nc.publish(event_subject(event_tag(event)), encode_event(event))
        if n % 5000 == 0:
            await nc.flush()
    await nc.flush()
    js = nc.jetstream()
    while (await js.stream_info("EXO_EVENTS")).state.last_seq < stop - 1:
        await asyncio.sleep(0.05)


async def time_catch_up(nc: Connection, use_snapshot: bool) -> tuple[float, State]:
    started = time.perf_counter()
    view, _ = await catch_up(nc, use_snapshot=use_snapshot)
    elapsed = time.perf_counter() - started
    await view.stop()
    return elapsed, view.state


async def bench_late_join(nc: Connection, sizes: list[int], elections: int,
                          signer: ChunkSigner) -> list[tuple[int, float, float, int]]:
    """Each snapshot signed by a master that the log shows elected `elections` times, first (a
    starting node reads every election to check the signature: docs/deploy.md, "Per-node identities")."""
    rows: list[tuple[int, float, float, int]] = []
    for n in range(elections):
        elected = LeaderElected(node_id=NodeId(signer.node_id), lease_revision=n + 1, public_key=signer.public_key)
        await EventLog(nc).append(elected, f"bench-election-{n}")
    term = max(1, elections)  # the last election's sequence: the history's tasks carry it
    appended = elections
    for size in sizes:
        await append_history(nc, appended + 1, size + 1, term)
        replay_s, state = await time_catch_up(nc, use_snapshot=False)
        await write_snapshot(nc, state, signer=signer)
        await append_history(nc, size + 1, size + TAIL + 1, term)
        appended = size + TAIL
        snapshot_s, _ = await time_catch_up(nc, use_snapshot=True)
        rows.append((size, replay_s, snapshot_s, len(encode_state(state))))
        print(f"  {size:>9,} events: replay {replay_s:8.3f} s, snapshot + {TAIL} tail {snapshot_s:6.3f} s", flush=True)
    return rows


async def bench_images(nc: Connection, megabytes: int) -> dict[str, float]:
    data = os.urandom(megabytes * 1024 * 1024)
    started = time.perf_counter()
    digest, _ = await store_image(nc, data)
    upload = time.perf_counter() - started
    started = time.perf_counter()
    await store_image(nc, data)
    second = time.perf_counter() - started
    started = time.perf_counter()
    assert await fetch_image(nc, digest) == data
    fetch = time.perf_counter() - started
    store = await nc.jetstream().object_store(IMAGES_BUCKET)
    started = time.perf_counter()
    await store.get(digest)
    library_get = time.perf_counter() - started
    return {"upload": upload, "second": second, "fetch": fetch, "library_get": library_get}


async def main(sizes: list[int], image_mb: int, elections: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        server = EmbeddedNats(Path(tmp) / "nats", port=0)
        url = await server.start()
        try:
            nc = await connect([url], name="bench")
            await provision(nc)
            print("late join (time until ready to plan):", flush=True)
            signer = ChunkSigner.from_file("bench-master", load_node_key(Path(tmp) / "master").seed_file)
            rows = await bench_late_join(nc, sizes, elections, signer)
            images = await bench_images(nc, image_mb)
            await nc.close()
        finally:
            server.stop()
    print(f"\n{'events':>10} {'replay from 1':>15} {'snapshot + tail':>17} {'speed-up':>9} {'snapshot size':>14}")
    for size, replay_s, snapshot_s, snapshot_bytes in rows:
        print(f"{size:>10,} {replay_s:>13.3f} s {snapshot_s:>15.3f} s {replay_s / snapshot_s:>8.1f}x "
              f"{snapshot_bytes / 1e6:>11.2f} MB")
    mb = image_mb
    print(f"\nimage of {mb} MB: upload {mb / images['upload']:.0f} MB/s ({images['upload'] * 1000:.0f} ms), "
          f"second send {images['second'] * 1000:.1f} ms (upload skipped), "
          f"worker fetch {mb / images['fetch']:.0f} MB/s ({images['fetch'] * 1000:.0f} ms) "
          f"vs nats-py ObjectStore.get {mb / images['library_get']:.0f} MB/s ({images['library_get'] * 1000:.0f} ms)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="10000,100000,1000000")
    parser.add_argument("--image-mb", type=int, default=10)
    parser.add_argument("--elections", type=int, default=1, help="elections in the log (each read at a start)")
    args = parser.parse_args()
    asyncio.run(main([int(s) for s in args.sizes.split(",")], args.image_mb, args.elections))
