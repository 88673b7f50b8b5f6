"""The leading master's snapshots of State into the KV bucket (exo/bus/snapshots.py writes them)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

from exo.bus.chunk_signing import ChunkSigner
from exo.bus.connection import Connection
from exo.bus.snapshots import write_snapshot
from exo.bus.state_view import StateView
from exo.core.events import AnyEvent
from exo.core.state import State

log = logging.getLogger("exo.master.service")  # the master's lines under one name, as before this module


class Snapshotter:
    """Writes State to the KV bucket every `every` events or `interval` seconds, whichever first."""

    def __init__(self, nc: Connection, view: StateView, every: int, interval: float,
                 signer: ChunkSigner | None = None) -> None:
        self._nc = nc
        self._signer = signer  # this node's key: a starting node uses only snapshots a master signed
        self._names = view.names
        self._view = view
        self._every = every
        self._interval = interval
        self._due = asyncio.Event()
        self._written_seq = 0
        view.add_listener(self._on_event)

    def _on_event(self, seq: int, event: AnyEvent, state: State) -> None:
        if seq - self._written_seq >= self._every:
            self._due.set()

    async def run(self, still_leader: Callable[[], bool]) -> None:
        while still_leader():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._due.wait(), self._interval)
            self._due.clear()
            state = self._view.state
            if state.last_seq > self._written_seq and still_leader():
                started = time.perf_counter()
                written = await write_snapshot(self._nc, state, names=self._names, signer=self._signer)
                self._written_seq = state.last_seq  # not written: try again with the next `every` events
                if written:
                    log.info("snapshot at sequence %d (%.0f ms)", state.last_seq, (time.perf_counter() - started) * 1000)
