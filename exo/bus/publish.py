"""JetStream publishes that ride out a leader change or a reconnect.

A retry keeps the same Nats-Msg-Id, so the server's duplicate window turns a publish that
did land (but whose ack was lost) into a no-op that returns the original sequence: nothing
is lost and nothing is written twice.
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from contextvars import ContextVar

import nats.errors
import nats.js.errors
from nats.aio.client import Client
from nats.js.api import PubAck
from nats.js.client import JetStreamContext

from exo.bus import broker_trouble
from exo.bus.errors import BusError
from exo.telemetry.tracing import with_traceparent

log = logging.getLogger(__name__)

_TRANSIENT = (
    nats.errors.TimeoutError,
    nats.errors.NoRespondersError,
    nats.js.errors.NoStreamResponseError,
    nats.js.errors.ServiceUnavailableError,
    nats.errors.ConnectionReconnectingError,
    nats.errors.OutboundBufferLimitError,
    nats.errors.StaleConnectionError,
)

RETRY_FOR_S = 30.0
# How long publishes in this task keep retrying when no retry_for is given: RETRY_FOR_S for the
# services; less under an API request, whose client waits (exo/api/bus_outage.py sets it per request).
publish_patience: ContextVar[float] = ContextVar("publish_patience", default=RETRY_FOR_S)


_contexts: weakref.WeakKeyDictionary[Client, JetStreamContext] = weakref.WeakKeyDictionary()


def jetstream_of(nc: Client) -> JetStreamContext:
    """One JetStream context per connection, not one per publish (1.7% of an API node's profile
    samples, docs/scaling.md); its publish keeps nothing between calls."""
    context = _contexts.get(nc)
    if context is None:
        context = _contexts[nc] = nc.jetstream()
    return context


async def publish_durably(
    nc: Client, subject: str, payload: bytes, stream: str, msg_id: str, retry_for: float | None = None, traceparent: str = "",
    headers: dict[str, str] | None = None,
) -> PubAck:
    """`traceparent`: the span that sends it, carried in the headers to whoever reads it (exo/telemetry);
    `headers`: more of them (a chunk's signature)."""
    retry_for = publish_patience.get() if retry_for is None else retry_for
    headers = with_traceparent({**(headers or {}), "Nats-Msg-Id": msg_id}, traceparent)
    js = jetstream_of(nc)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + retry_for
    delay = 0.05
    while True:
        try:
            return await js.publish(subject, payload, stream=stream, headers=headers, timeout=2)
        except _TRANSIENT as error:
            if loop.time() + delay > deadline:
                raise BusError(f"could not publish to {stream} for {retry_for:.0f} s: {error!r}") from error
            broker_trouble.note()
            log.info("publish to %s not acknowledged (%r); retrying with the same id", stream, error)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 1.0)
