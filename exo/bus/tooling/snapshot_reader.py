"""Every snapshot the exo-state bucket still keeps, undecoded, for `exo replay` and `exo inspect`.

Undecoded on purpose: a tool must be able to say "revision 7 is not a State" instead of failing
on it, which exo.bus.snapshots (the node's reader) does not need to do.
"""

from __future__ import annotations

import datetime

import msgspec
from nats.aio.client import Client
from nats.js.errors import BucketNotFoundError, NotFoundError

from exo.bus.snapshots import snapshot_entries
from exo.bus.subjects import SHARED, LogNames


class StoredSnapshot(msgspec.Struct, frozen=True, kw_only=True):
    revision: int  # the KV revision (the bucket stream's sequence)
    created_ns: int  # when it was written, nanoseconds since the epoch
    value: bytes


async def stored_snapshots(nc: Client, names: LogNames = SHARED) -> list[StoredSnapshot]:
    """Oldest first (the shared log's, or a master group's). Deleted or purged revisions (empty values) are left out."""
    try:
        entries = await snapshot_entries(nc, names=names)
    except (BucketNotFoundError, NotFoundError):
        return []
    return [
        StoredSnapshot(revision=e.revision or 0, created_ns=_nanoseconds(e.created), value=e.value)
        for e in entries
        if e.value
    ]


def _nanoseconds(created: datetime.datetime | int | None) -> int:
    # nats-py types Entry.created as int but fills it with the message's datetime.
    if isinstance(created, datetime.datetime):
        return int(created.timestamp() * 1_000_000) * 1000
    return created or 0
