"""Reading the event log as raw records, fast, for the operator tools (replay, export, tail).

A record is what the stream holds: sequence, subject, store time, headers and the payload
bytes, undecoded, so a tool can show or export events that do not decode. A bounded read
(`read_log`, `read_log_batches`) uses a push consumer with flow control on a connection of its
own whose protocol parser hands the consumer's messages over in batches, without nats-py's
per-message machinery (see "The raw reader" below); the follower (`LogFollower`) and the
fallback use nats-py's callback-based ordered push consumer. (Pull fetching and per-message
gets are several times slower for a million events; see docs/benchmarks.md.)
"""

from __future__ import annotations

import asyncio
import logging

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import api

from exo.bus.connection import connect_like
from exo.bus.errors import BusError, LogGap
from exo.bus.subjects import ALL_EVENTS, EVENTS_STREAM, SHARED, LogNames
from exo.bus.tooling.log_records import HEARTBEAT_S, LogBounds, LogRecord, OnBatch, OnRecord, unsubscribe_quietly
from exo.bus.tooling.raw_reader import HeaderMode, RawParser, RawRangeReader

__all__ = ["LogBounds", "LogFollower", "LogRecord", "log_bounds", "read_log", "read_log_batches", "read_log_ordered",
           "read_log_fetching", "record_of"]

log = logging.getLogger(__name__)


def record_of(msg: Msg) -> LogRecord:
    """A record from a message delivered by a JetStream consumer (its reply subject carries
    the stream sequence and store time; parsed here directly, it is on the hot path)."""
    tokens = msg.reply.split(".")
    if len(tokens) == 9:  # $JS.ACK.<stream>.<consumer>.<delivered>.<sseq>.<cseq>.<ts>.<pending>
        seq, time_ns = int(tokens[5]), int(tokens[7])
    else:  # with domain and account hash: $JS.ACK.<domain>.<hash>.<stream>.<consumer>.<delivered>.<sseq>...
        seq, time_ns = int(tokens[7]), int(tokens[9])
    return LogRecord(seq=seq, subject=msg.subject, time_ns=time_ns, headers=msg.headers, data=msg.data)


async def log_bounds(nc: Client, names: LogNames = SHARED) -> LogBounds:
    state = (await nc.jetstream().stream_info(names.events_stream)).state
    return LogBounds(first_seq=state.first_seq if state.messages else 0, last_seq=state.last_seq)


async def read_log(
    nc: Client, on_record: OnRecord, first_seq: int = 1, last_seq: int | None = None, stall_timeout: float = 10.0
) -> int:
    """Call `on_record` for every stored event from `first_seq` to `last_seq` (default: the
    last one stored when the read starts), in order. Returns how many were delivered.

    Raises LogGap when the stream no longer holds `first_seq` (nats-py would silently start
    at the stream's first sequence), and BusError when the server stops sending for
    `stall_timeout` seconds. An exception raised by `on_record` ends the read and is re-raised.
    """

    def on_batch(records: list[LogRecord]) -> None:
        for record in records:
            on_record(record)

    return await read_log_batches(nc, on_batch, first_seq, last_seq, stall_timeout)


async def read_log_batches(
    nc: Client, on_batch: OnBatch, first_seq: int = 1, last_seq: int | None = None, stall_timeout: float = 10.0,
    headers: HeaderMode = True, names: LogNames = SHARED,
) -> int:
    """`read_log`, handing over records as they arrive, many at a time (whatever one read
    from the socket holds, ~100), in order. `headers=False` leaves every record's headers None,
    `headers=SIGNED` all but a signed one's (replay checks events' signatures; parsing every
    record's headers costs about as much as the rest of a read).

    It reads on a connection of its own whose protocol parser hands this consumer's messages
    over raw (`RawParser`), several times faster than nats-py's Msg per message; if that
    parser cannot be installed (another nats-py), it reads through nats-py's ordered consumer.
    """
    end = await _end_of_read(nc, first_seq, last_seq, names)
    if end < first_seq:
        return 0
    reader_nc = await _reader_connection(nc)
    if reader_nc is None:
        return await _read_ordered(nc, on_batch, first_seq, end, stall_timeout, names)
    try:
        if not RawParser.install(reader_nc):
            log.warning("nats-py's protocol parser is not the one exo knows: reading the log the slow way")
            return await _read_ordered(nc, on_batch, first_seq, end, stall_timeout, names)
        return await RawRangeReader(nc, reader_nc, on_batch, first_seq, end, headers, names).run(stall_timeout)
    finally:
        await reader_nc.close()


async def read_log_ordered(
    nc: Client, on_batch: OnBatch, first_seq: int = 1, last_seq: int | None = None, stall_timeout: float = 10.0
) -> int:
    """The same read through nats-py's own ordered push consumer (callback), one Msg at a time:
    the fallback, and what bench/replay.py compares the raw reader with."""
    end = await _end_of_read(nc, first_seq, last_seq)
    if end < first_seq:
        return 0
    return await _read_ordered(nc, on_batch, first_seq, end, stall_timeout)


async def _end_of_read(nc: Client, first_seq: int, last_seq: int | None, names: LogNames = SHARED) -> int:
    """The last sequence a read from `first_seq` to `last_seq` (None: the stream's last one
    now) delivers; below `first_seq` if there is nothing to read. LogGap if the stream no
    longer holds `first_seq` (nats-py would silently start at the stream's first sequence)."""
    bounds = await log_bounds(nc, names)
    end = bounds.last_seq if last_seq is None else min(last_seq, bounds.last_seq)
    if bounds.first_seq == 0 or end < first_seq:
        return first_seq - 1
    if bounds.first_seq > first_seq:
        raise LogGap(f"the event stream starts at sequence {bounds.first_seq}; sequences from {first_seq} are gone")
    return end


async def _reader_connection(nc: Client) -> Client | None:
    """A connection of the reader's own to the server `nc` uses, with the same credentials, or None
    if there is none to be had (then the read uses `nc`)."""
    url = nc.connected_url
    if url is None:
        return None
    try:
        return await connect_like(nc, url.geturl(), name="exo-log-reader")
    except BusError as error:
        log.warning("reading the log the slow way: %s", error)
        return None


async def _read_ordered(nc: Client, on_batch: OnBatch, first_seq: int, end: int, stall_timeout: float,
                        names: LogNames = SHARED) -> int:
    reader = _RangeReader(lambda record: on_batch([record]), first_seq, end)
    subscription = await nc.jetstream().subscribe(
        names.all_events, stream=names.events_stream, ordered_consumer=True, cb=reader.on_msg, idle_heartbeat=HEARTBEAT_S,
        deliver_policy=api.DeliverPolicy.BY_START_SEQUENCE, config=api.ConsumerConfig(opt_start_seq=first_seq),
    )
    try:
        await reader.wait(stall_timeout)
    finally:
        await unsubscribe_quietly(subscription)
    return reader.delivered


class _RangeReader:
    def __init__(self, on_record: OnRecord, first: int, end: int) -> None:
        self._on_record = on_record
        self._first = first
        self._next = first  # the lowest sequence still to deliver
        self._end = end
        self._done = asyncio.Event()
        self.delivered = 0
        self.error: BaseException | None = None

    async def on_msg(self, msg: Msg) -> None:
        if self._done.is_set():
            return  # past the end, or the callback failed: drain quietly
        record = record_of(msg)
        if record.seq < self._next:
            # Already delivered, or before our start: nats-py recreates an ordered consumer from
            # the last sequence it saw plus one, which is 1 if it had seen none yet.
            return
        if self.delivered == 0 and record.seq > self._first:
            # The head aged out between our look at the stream and the subscription.
            self.error = LogGap(f"the event stream starts at sequence {record.seq}; sequences from {self._first} are gone")
            self._done.set()
            return
        self._next = record.seq + 1
        if record.seq > self._end:
            self._done.set()
            return
        try:
            self._on_record(record)
        except Exception as error:  # handed back to the caller of read_log
            self.error = error
            self._done.set()
            return
        self.delivered += 1
        if record.seq >= self._end:
            self._done.set()

    async def wait(self, stall_timeout: float) -> None:
        seen = -1
        while not self._done.is_set():
            if self.delivered == seen:
                raise BusError(f"the event stream stopped sending after {seen} events ({stall_timeout} s without one)")
            seen = self.delivered
            try:
                await asyncio.wait_for(self._done.wait(), stall_timeout)
            except TimeoutError:
                continue
        if self.error is not None:
            raise self.error


async def read_log_fetching(nc: Client, on_record: OnRecord, first_seq: int = 1, batch: int = 1000) -> int:
    """The same read as `read_log` through a pull consumer, one fetch request per `batch`.
    Not used by the tools: it is the slower way, kept so bench/replay.py compares like with like."""
    end = (await log_bounds(nc)).last_seq
    config = api.ConsumerConfig(ack_policy=api.AckPolicy.NONE, deliver_policy=api.DeliverPolicy.BY_START_SEQUENCE,
                                opt_start_seq=first_seq, inactive_threshold=30.0)
    subscription = await nc.jetstream().pull_subscribe(ALL_EVENTS, stream=EVENTS_STREAM, config=config)
    delivered, seq = 0, first_seq - 1
    try:
        while seq < end:
            for msg in await subscription.fetch(batch=batch, timeout=10):
                record = record_of(msg)
                seq = record.seq
                on_record(record)
                delivered += 1
    finally:
        await unsubscribe_quietly(subscription)
    return delivered


class LogFollower:
    """Delivers events as they are appended, from `start_seq` (None: only new ones), until stopped."""

    def __init__(self, nc: Client, on_record: OnRecord) -> None:
        self._js = nc.jetstream()
        self._on_record = on_record
        self._subscription: Subscription | None = None
        self._next = 0  # the lowest sequence still to deliver (0: whatever comes first)

    async def start(self, start_seq: int | None = None) -> None:
        if start_seq is None:
            policy, config = api.DeliverPolicy.NEW, None
        else:
            self._next = max(start_seq, 1)
            policy, config = api.DeliverPolicy.BY_START_SEQUENCE, api.ConsumerConfig(opt_start_seq=self._next)
        self._subscription = await self._js.subscribe(
            ALL_EVENTS, stream=EVENTS_STREAM, ordered_consumer=True, cb=self._on_msg, idle_heartbeat=HEARTBEAT_S,
            deliver_policy=policy, config=config,
        )

    async def stop(self) -> None:
        if self._subscription is not None:
            await unsubscribe_quietly(self._subscription)
            self._subscription = None

    async def _on_msg(self, msg: Msg) -> None:
        record = record_of(msg)
        if record.seq < self._next:
            return  # resent by a recreated consumer (see _RangeReader.on_msg)
        self._next = record.seq + 1
        self._on_record(record)
