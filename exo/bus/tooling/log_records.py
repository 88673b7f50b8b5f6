"""What the log readers hand over: records as the stream holds them, and shared small pieces."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING

import msgspec

if TYPE_CHECKING:
    from nats.aio.subscription import Subscription
    from nats.js import JetStreamContext


class LogRecord(msgspec.Struct, frozen=True, gc=False):
    seq: int
    subject: str
    time_ns: int  # when the server stored it, nanoseconds since the epoch
    headers: dict[str, str] | None
    data: bytes


class LogBounds(msgspec.Struct, frozen=True):
    first_seq: int  # 0 when the stream is empty
    last_seq: int


OnRecord = Callable[[LogRecord], None]

# Idle heartbeats tell an ordered consumer that the server lost it; 2 s finds that soon.
HEARTBEAT_S = 2.0

OnBatch = Callable[[list[LogRecord]], None]


async def unsubscribe_quietly(subscription: Subscription | JetStreamContext.PullSubscription) -> None:
    with contextlib.suppress(Exception):  # the connection may be closing already; the server drops the consumer itself
        await subscription.unsubscribe()
