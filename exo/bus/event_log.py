"""Appending to and following the indexed event log (the EXO_EVENTS stream).

Each event goes to exo.events.<tag> with Nats-Msg-Id = its event id, so a retried append is
deduplicated by the server; the PubAck's sequence is the event's index.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence

import msgspec
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import api

from exo.bus.atomic_append import MAX_ATOMIC, NOT_ENABLED, AtomicAppendFailed, append_atomically, signature_headers
from exo.bus.chunk_signing import ChunkSigner, message_check
from exo.bus.errors import LogGap
from exo.bus.publish import publish_durably
from exo.bus.subjects import SHARED, LogNames
from exo.core.event_signers import SignatureCheck
from exo.core.events import AnyEvent, Event, decode_event, encode_event, event_tag
from exo.telemetry import tracing

log = logging.getLogger(__name__)

# Called with (sequence, event, signature check) for decodable events and (sequence, reason) for
# the rest. The check says whether the event was signed by a given key (exo/core/event_signers.py).
OnEvent = Callable[[int, AnyEvent, SignatureCheck], Awaitable[None]]
OnUndecodable = Callable[[int, str], Awaitable[None]]


class EventLog:
    def __init__(self, nc: Client, names: LogNames = SHARED, signer: ChunkSigner | None = None) -> None:
        """`signer`: the node's key, which signs each event appended (exo/core/event_signers.py)."""
        self._nc = nc
        self._js = nc.jetstream()
        self.names = names
        self.atomic = False  # the stream stores atomic batches (see `check_atomic`)
        self._signer = signer

    async def append(self, event: Event, event_id: str, traceparent: str = "") -> int:
        """Append one event; returns its sequence (the original one if it was a duplicate)."""
        names = self.names
        subject, payload = names.event_subject(event_tag(event)), encode_event(event)
        ack = await publish_durably(self._nc, subject, payload, names.events_stream, event_id, traceparent=traceparent,
                                    headers=signature_headers(self._signer, event, subject, payload))
        return ack.seq

    async def check_atomic(self) -> bool:
        """Whether the stream takes atomic batches (streams/EXO_EVENTS.json allows them; a stream an
        operator made without, or a server before 2.12, does not)."""
        info = await self._js.stream_info(self.names.events_stream)
        self.atomic = bool(info.config.allow_atomic)
        return self.atomic

    async def append_all(self, events: Sequence[tuple[Event, str]], traces: Mapping[str, str] | None = None) -> list[int]:
        """Append in order; each event's sequence. Where the stream allows, as atomic batches (one
        round trip each, all or none: AtomicAppendFailed when one is not confirmed); else one by
        one, each with its id (a retry is deduplicated). `traces`: event id -> traceparent to carry."""
        seqs: list[int] = []
        traces = traces or {}
        while self.atomic and len(events) - len(seqs) > 1:
            batch = events[len(seqs):len(seqs) + MAX_ATOMIC]
            chunk = [event for event, _ in batch]
            try:
                last = await append_atomically(self._nc, chunk, self.names,
                                               [traces.get(event_id, "") for _, event_id in batch] if traces else (),
                                               self._signer)
            except AtomicAppendFailed as error:
                if error.err_code != NOT_ENABLED:
                    raise
                log.warning("%s no longer takes atomic batches (%s): appending one event at a time", self.names.events_stream,
                            error)
                self.atomic = False
                break
            seqs.extend(range(last - len(chunk) + 1, last + 1))
        for event, event_id in events[len(seqs):]:
            seqs.append(await self.append(event, event_id, traces.get(event_id, "")))
        return seqs

    async def last_sequence(self) -> int:
        info = await self._js.stream_info(self.names.events_stream)
        return info.state.last_seq


class EventFollower:
    """Delivers every event from `start_seq` on, in order, exactly once, to `on_event`.

    An ordered push consumer: the server streams to us with flow control, and nats-py
    recreates the consumer after a gap, so a slow reader never misses a sequence.
    """

    def __init__(self, nc: Client, on_event: OnEvent, on_undecodable: OnUndecodable, names: LogNames = SHARED) -> None:
        self._js = nc.jetstream()
        self._names = names
        self._on_event = on_event
        self._on_undecodable = on_undecodable
        self._next_seq = 1
        self._subscription: Subscription | None = None
        self.gap: str = ""  # set if the log skipped sequences this reader needed

    async def start(self, start_seq: int = 1) -> None:
        self._next_seq = start_seq
        info = await self._js.stream_info(self._names.events_stream)
        if info.state.messages and info.state.first_seq > start_seq:
            raise LogGap(
                f"the event stream starts at sequence {info.state.first_seq} but this reader needs "
                f"{start_seq}: its history was trimmed and there is no snapshot that covers it"
            )
        config = api.ConsumerConfig(opt_start_seq=start_seq)
        self._subscription = await self._js.subscribe(
            self._names.all_events,
            stream=self._names.events_stream,
            ordered_consumer=True,
            deliver_policy=api.DeliverPolicy.BY_START_SEQUENCE,
            config=config,
            cb=self._deliver,
            idle_heartbeat=2.0,
        )

    async def stop(self) -> None:
        if self._subscription is not None:
            with contextlib.suppress(Exception):  # the connection may already be closed on shutdown
                await self._subscription.unsubscribe()
            self._subscription = None

    async def _deliver(self, msg: Msg) -> None:
        seq = msg.metadata.sequence.stream
        if seq < self._next_seq:
            return  # already applied (a consumer recreated after a reconnect resends)
        if seq > self._next_seq:
            # The server silently starts later than asked when the history was trimmed.
            self.gap = f"the event log skipped from sequence {self._next_seq} to {seq}"
            log.error(self.gap)
        self._next_seq = seq + 1
        try:
            event = decode_event(msg.data)
        except (msgspec.DecodeError, msgspec.ValidationError) as error:
            await self._on_undecodable(seq, f"undecodable event on {msg.subject}: {error}")
            return
        # A traced request's event: this node's listeners (its worker's plan) act inside the trace.
        with tracing.span("exo.events.deliver", tracing.traceparent_of(msg.headers), "consumer",
                          {"exo.event": msg.subject, "exo.seq": seq}):
            await self._on_event(seq, event, message_check(msg.subject, msg.data, msg.headers))
