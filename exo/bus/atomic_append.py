"""Appending several events as one JetStream atomic batch (nats-server 2.12+, ADR-50).

The master appends a batch of decisions in one round trip: every message but the last is
published without waiting, and the last commits the batch. JetStream stores all of them,
contiguously and in order, or none: never a later decision without an earlier one it was made
on. nats-py 2.16 has no API for it; it is four headers on plain publishes.

An atomic batch cannot carry Nats-Msg-Id, so a commit whose answer is lost cannot be retried
(it may have landed). The caller fences instead: it stops leading, and the next term decides the
batch's commands again, where a command answered by events that did land is answered from State.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence

import nats.errors
from nats.aio.client import Client

from exo.bus.chunk_signing import ChunkSigner
from exo.bus.errors import BusError
from exo.bus.subjects import SHARED, LogNames
from exo.core.event_signers import is_signed
from exo.core.events import Event, encode_event, event_tag
from exo.telemetry.tracing import with_traceparent

MAX_ATOMIC = 1000  # the server's limit on messages per atomic batch
COMMIT_TIMEOUT_S = 5.0
NOT_ENABLED = 10174  # "atomic publish is disabled" on the stream: nothing was stored

BATCH_HEADERS = ("Nats-Batch-Id", "Nats-Batch-Sequence", "Nats-Batch-Commit")


class AtomicAppendFailed(BusError):
    """The batch was not confirmed stored. `stored_none`: the server said so; else it may have landed."""

    def __init__(self, reason: str, stored_none: bool = False, err_code: int = 0) -> None:
        super().__init__(reason)
        self.stored_none = stored_none
        self.err_code = err_code


async def append_atomically(nc: Client, events: Sequence[Event], names: LogNames = SHARED,
                            traceparents: Sequence[str] = (), signer: ChunkSigner | None = None) -> int:
    """Append `events` (at most MAX_ATOMIC) all or none, in order; the last one's sequence.
    `traceparents`: each event's, carried in its headers (none: no event is traced); `signer`: the
    node's key, which signs each (exo/core/event_signers.py)."""
    if not 0 < len(events) <= MAX_ATOMIC:
        raise ValueError(f"an atomic batch holds 1 to {MAX_ATOMIC} events, not {len(events)}")
    batch_id = uuid.uuid4().hex
    messages = [(names.event_subject(event_tag(event)), encode_event(event)) for event in events]
    signatures = [signature_headers(signer, event, subject, payload)
                  for event, (subject, payload) in zip(events, messages, strict=True)]
    try:
        for n, (subject, payload) in enumerate(messages[:-1], start=1):
            await nc.publish(subject, payload, headers=with_traceparent(
                {**signatures[n - 1], "Nats-Batch-Id": batch_id, "Nats-Batch-Sequence": str(n)},
                traceparents[n - 1] if traceparents else ""))
        subject, payload = messages[-1]
        reply = await nc.request(subject, payload, timeout=COMMIT_TIMEOUT_S, headers=with_traceparent(
            {**signatures[-1], "Nats-Batch-Id": batch_id, "Nats-Batch-Sequence": str(len(events)), "Nats-Batch-Commit": "1"},
            traceparents[-1] if traceparents else ""))
    except (nats.errors.TimeoutError, nats.errors.ConnectionReconnectingError, nats.errors.StaleConnectionError,
            nats.errors.ConnectionClosedError) as error:  # the commit may have been sent, or be sent on reconnecting
        raise AtomicAppendFailed(f"the batch's commit was not answered: {error!r}") from error
    except nats.errors.Error as error:  # refused before the commit left (too big, no stream leader...): none stored
        raise AtomicAppendFailed(f"the batch could not be sent: {error!r}", stored_none=True) from error
    return _committed_seq(reply.data, batch_id, len(events))


def signature_headers(signer: ChunkSigner | None, event: Event, subject: str, payload: bytes) -> dict[str, str]:
    """The headers that sign `event` as its node appends it ({}: no key, or a request's own event)."""
    return signer.headers(subject, payload) if signer is not None and is_signed(event) else {}


def _committed_seq(data: bytes, batch_id: str, count: int) -> int:
    try:
        ack = json.loads(data or b"{}")
    except ValueError as error:
        raise AtomicAppendFailed(f"the batch's commit was answered with {data[:200]!r}") from error
    if refusal := ack.get("error"):
        raise AtomicAppendFailed(f"the batch was refused: {refusal.get('description', refusal)}", stored_none=True,
                                 err_code=refusal.get("err_code") or 0)
    if ack.get("batch") != batch_id or ack.get("count") != count or not isinstance(ack.get("seq"), int):
        # A server that does not know atomic batches stores each message as it comes: say so loudly.
        raise AtomicAppendFailed(f"the batch's commit was answered without the batch ({ack}): "
                                 "the server does not store atomic batches")
    seq: int = ack["seq"]
    return seq
