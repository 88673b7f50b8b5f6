"""What the log shows about who may sign a snapshot (exo/core/snapshot_trust.py decides): the
log's elections, read by their subject alone (`<log>.leader.elected`), one message get each, so a
starting node reads neither heartbeats nor requests twice.

The event stream's retention (streams/EXO_EVENTS.json: 30 days, 8 GiB) can drop old elections: a
master whose every election the log no longer holds cannot have its snapshots used (docs/deploy.md,
"Per-node identities").
"""

from __future__ import annotations

import contextlib

import msgspec
from nats.aio.client import Client
from nats.js.errors import NotFoundError

from exo.bus.jetstream_api import get_stored
from exo.bus.subjects import SHARED, LogNames
from exo.core.events import AnyEvent, LeaderElected, decode_event
from exo.core.snapshot_trust import SnapshotSigners, snapshot_signers

_ELECTED = str(LeaderElected.__struct_config__.tag)


async def read_snapshot_signers(nc: Client, names: LogNames = SHARED, log_first: int = 1) -> SnapshotSigners:
    """`log_first`: the log's first stored sequence (over 1: older elections may be gone)."""
    elections = [(seq, event) for seq, event in await _events_on(nc, names, _ELECTED) if isinstance(event, LeaderElected)]
    return snapshot_signers(names.group, elections, trimmed_before=log_first if log_first > 1 else 0)


async def _events_on(nc: Client, names: LogNames, tag: str) -> list[tuple[int, AnyEvent]]:
    """Every stored event on the subject of `tag`, in order (one that does not decode is left out:
    the reducer skips it too)."""
    js, subject = nc.jetstream(), names.event_subject(tag)
    found: list[tuple[int, AnyEvent]] = []
    seq = 1
    while True:
        try:
            msg = await get_stored(js, names.events_stream, seq=seq, subject=subject, next_by_subject=True)
        except NotFoundError:
            return found
        seq = msg.seq or seq
        with contextlib.suppress(msgspec.DecodeError, msgspec.ValidationError):
            found.append((seq, decode_event(msg.data or b"")))
        seq += 1
