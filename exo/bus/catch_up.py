"""Catching up: the latest snapshot plus the tail of the log, applied up to the log's end at
the time we started following. Nothing on a node acts on State before this returns."""

from __future__ import annotations

import logging
import time

from nats.aio.client import Client

from exo.bus.errors import LogGap
from exo.bus.event_log import EventLog
from exo.bus.snapshots import read_latest_snapshot
from exo.bus.state_view import StateView
from exo.bus.subjects import SHARED, LogNames

log = logging.getLogger(__name__)


async def catch_up(nc: Client, use_snapshot: bool = True, timeout: float = 600.0,
                   names: LogNames = SHARED) -> tuple[StateView, int]:
    """A live view that has applied the whole log, and the snapshot sequence it started from."""
    for attempt in range(2):
        snapshot = await read_latest_snapshot(nc, names) if use_snapshot else None
        view = StateView(nc, snapshot, names)
        last_seq = await EventLog(nc, names).last_sequence()
        started = time.perf_counter()
        try:
            await view.start()
        except LogGap:
            if attempt == 0 and use_snapshot:
                continue  # a newer snapshot may have been written meanwhile
            raise
        await view.wait_for(last_seq, timeout=timeout)
        if view.gap:
            await view.stop()
            raise LogGap(view.gap)
        from_seq = snapshot.last_seq if snapshot else 0
        log.info("%s caught up to sequence %d from a snapshot at %d in %.0f ms",
                 names.events_stream, view.state.last_seq, from_seq, (time.perf_counter() - started) * 1000)
        return view, from_seq
    raise AssertionError("unreachable")
