"""Appends probe events to the log through exo's own durable publish while a fault happens,
and records every acknowledgement the server gave: (sequence, Nats-Msg-Id). Each one must
still be in EXO_EVENTS afterwards, at that sequence, however the fault fell between publish
and ack. A probe is a node.timed_out for a node no State has, so every reducer skips it."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid

from exo.bus.connection import connect
from exo.bus.errors import BusError
from exo.bus.event_log import EventLog
from exo.core.events import NodeTimedOut
from exo.core.ids import NodeId

PROBE_NODE = NodeId("ack-probe")


class AckRecorder:
    def __init__(self, urls: list[str], pause_s: float = 0.01) -> None:
        self.urls = urls
        self.pause_s = pause_s
        self.acked: list[tuple[int, str]] = []
        self.acked_at: list[float] = []  # time.monotonic() of each ack, in the order of `acked`
        self.unacked = 0  # publishes that gave up: allowed, they were never promised
        self._run_id = uuid.uuid4().hex[:8]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    async def _run(self) -> None:
        nc = await connect(self.urls, name="test-ack-recorder")
        log = EventLog(nc)
        n = 0
        try:
            while not self._stop.is_set():
                msg_id = f"{PROBE_NODE}:{self._run_id}:{n}"
                try:
                    seq = await log.append(NodeTimedOut(node_id=PROBE_NODE, reason="probe"), event_id=msg_id)
                    self.acked.append((seq, msg_id))
                    self.acked_at.append(time.monotonic())
                except BusError:
                    self.unacked += 1
                n += 1
                await asyncio.sleep(self.pause_s)
        finally:
            await nc.close()

    def __enter__(self) -> AckRecorder:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(60)

    def acks_between(self, start: float, end: float) -> int:
        return sum(start <= at <= end for at in self.acked_at)

    def missing_from(self, events: list[tuple[int, str]]) -> list[tuple[int, str]]:
        """Acknowledged (sequence, msg id) pairs that `events` (the log read afterwards) lacks."""
        stored = set(events)
        return [ack for ack in self.acked if ack not in stored]
