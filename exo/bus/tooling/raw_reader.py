"""The raw reader: a bounded read of the event log without nats-py's per-message machinery."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
from collections.abc import Awaitable, Callable
from typing import Literal

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.errors import ProtocolError
from nats.js import api
from nats.protocol.parser import AWAITING_CONTROL_LINE, ERR_RE, INFO_RE, OK_RE, PING_RE, PONG_RE, Parser

from exo.bus.chunk_signing import SIGNATURE_HEADER
from exo.bus.errors import BusError, LogGap
from exo.bus.subjects import SHARED, LogNames
from exo.bus.tooling.log_records import HEARTBEAT_S, LogRecord, OnBatch, unsubscribe_quietly

log = logging.getLogger(__name__)

# --- The raw reader -------------------------------------------------------------------------
#
# nats-py spends ~13-20 µs on each message it delivers (regex-parsing the protocol line, a Msg
# object, its headers as a dict, ordered-consumer bookkeeping that splits the reply subject
# three times, an asyncio queue hop to the callback). A replay of a million events does not
# need any of that per message: `RawParser` takes the place of nats-py's protocol parser on a
# connection of the reader's own, hands the consumer's messages over as plain tuples, many per
# socket read, and passes everything else (PING, INFO, errors, other subscriptions) to nats-py
# exactly as its own parser would. `RawRangeReader` does the consumer's part that nats-py's
# ordered consumer did: it creates a push consumer with flow control and idle heartbeats,
# answers flow control, and recreates the consumer from the next sequence if a message is lost.

# A message of the raw subscription: (subject, reply, stream sequence, consumer sequence, store
# time, headers, payload). For a message the stream stored, the numbers come from its reply
# subject (and the reply itself is left b""); for the server's own status messages (idle
# heartbeats, flow control requests) the sequence is 0 and the reply is kept.
RawMessage = tuple[bytes, bytes, int, int, int, bytes, bytes]
OnRaw = Callable[[list[RawMessage]], Awaitable[None]]


class RawParser(Parser):
    """nats-py's protocol parser, except that the messages of one JetStream push subscription
    (`raw_sid`) go to `on_raw` in batches of RawMessage, as few Python operations per message
    as possible. Until `raw_sid` is set it is nats-py's parser. `on_raw` must not raise: an
    exception here ends nats-py's read loop."""

    def __init__(self, nc: Client) -> None:
        super().__init__(nc)
        self.raw_sid = b""
        self.on_raw: OnRaw | None = None
        self._stored: re.Pattern[bytes] | None = None  # the protocol line of a stored message for raw_sid (a compiled regex)

    @classmethod
    def install(cls, nc: Client) -> bool:
        """Put a RawParser in place of a fresh connection's parser (no subscriptions yet, so
        nothing half-parsed can be lost); False if this nats-py does not look as expected."""
        current = getattr(nc, "_ps", None)
        if type(current) is not Parser or current.state != AWAITING_CONTROL_LINE or current.buf or nc._subs:
            return False
        nc._ps = cls(nc)
        return True

    def set_raw_sid(self, sid: int | None) -> None:
        self.raw_sid = b"" if sid is None else str(sid).encode()
        # HMSG <subject> <sid> $JS.ACK.<stream>.<consumer>.<delivered>.<sseq>.<cseq>.<ts>.<pending> <hlen> <len>
        self._stored = None if sid is None else re.compile(
            rb"HMSG ([^ \r\n]+) " + self.raw_sid
            + rb" \$JS\.ACK\.[^. \r\n]+\.[^. \r\n]+\.[0-9]+\.([0-9]+)\.([0-9]+)\.([0-9]+)\.[0-9]+ ([0-9]+) ([0-9]+)\r\n"
        )

    async def parse(self, data: bytes = b"") -> None:
        if self.on_raw is None or self.state != AWAITING_CONTROL_LINE:
            await super().parse(data)  # nats-py's, unannotated: it returns None
            return
        buf = self.buf
        buf.extend(data)
        view = bytes(buf)
        size, pos = len(view), 0
        batch: list[RawMessage] = []
        while pos < size:
            stored = self._stored.match(view, pos) if self._stored is not None else None
            if stored is not None:  # the common case, in as few steps as possible
                start = stored.end()
                stop = start + int(stored[6])
                if stop + 2 > size:
                    break
                header_end = start + int(stored[5])
                batch.append((stored[1], b"", int(stored[2]), int(stored[3]), int(stored[4]),
                              view[start:header_end], view[header_end:stop]))
                pos = stop + 2
                continue
            is_hmsg = view.startswith(b"HMSG ", pos)
            line_end = view.find(b"\r\n", pos)
            if line_end < 0:
                break  # the rest of the line is still on its way (as nats-py, however long it is)
            if not (is_hmsg or view.startswith(b"MSG ", pos)):
                line = view[pos:line_end + 2]
                pos = line_end + 2
                if not await self._hand_over(batch, pos):
                    return
                await self._control_line(line)
            else:
                subject, sid, reply, header_size, total = _msg_args(view[pos + (5 if is_hmsg else 4):line_end], is_hmsg)
                start = line_end + 2
                header_end, stop = start + header_size, start + total
                if stop + 2 > size:
                    break
                pos = stop + 2
                if sid == self.raw_sid:
                    batch.append(_raw_message(subject, reply, view[start:header_end], view[header_end:stop]))
                    continue
                # Another subscription's message: to nats-py, as its parser would.
                if not await self._hand_over(batch, pos):
                    return
                await self.nc._process_msg(int(sid), subject, reply, view[header_end:stop],
                                           view[start:header_end] if header_size else None)
            if self.buf is not buf:  # reset while we waited: a reconnect starts afresh
                return
            batch, view, size, pos = [], bytes(buf), len(buf), 0
        await self._hand_over(batch, pos)

    async def _hand_over(self, batch: list[RawMessage], consumed: int) -> bool:
        """Drop what was parsed from the buffer and deliver the batch; False if the parser was
        reset meanwhile (nothing more to parse from the old buffer)."""
        buf = self.buf
        del buf[:consumed]
        if batch and self.on_raw is not None:
            await self.on_raw(batch)
        return self.buf is buf

    async def _control_line(self, line: bytes) -> None:
        """One protocol line that is not a message, handled as nats-py's parser does."""
        if OK_RE.match(line):
            return
        if err := ERR_RE.match(line):
            await self.nc._process_err(err.groups()[0].decode().lower())
        elif PING_RE.match(line):
            await self.nc._process_ping()
        elif PONG_RE.match(line):
            await self.nc._process_pong()
        elif info := INFO_RE.match(line):
            await self.nc._process_info(json.loads(info.groups()[0].decode()))
        else:
            raise ProtocolError("nats: unknown protocol")


# Which records get their headers: all (True), none (False), or only signed ones (SIGNED: a replay
# checks events' signatures, and parsing every record's headers costs about as much as the rest of a read).
SIGNED: Literal["signed"] = "signed"
HeaderMode = bool | Literal["signed"]
_SIGNATURE = SIGNATURE_HEADER.encode() + b":"


def _raw_message(subject: bytes, reply: bytes, headers: bytes, data: bytes) -> RawMessage:
    """A message the parser's fast path did not take: a status message, or a stored one whose
    reply subject has the longer form (with a JetStream domain and account hash)."""
    tokens = reply.split(b".") if reply.startswith(b"$JS.ACK.") else []
    if len(tokens) == 9:  # $JS.ACK.<stream>.<consumer>.<delivered>.<sseq>.<cseq>.<ts>.<pending>
        return subject, b"", int(tokens[5]), int(tokens[6]), int(tokens[7]), headers, data
    if len(tokens) >= 11:  # $JS.ACK.<domain>.<hash>.<stream>.<consumer>.<delivered>.<sseq>.<cseq>.<ts>...
        return subject, b"", int(tokens[7]), int(tokens[8]), int(tokens[9]), headers, data
    return subject, reply, 0, 0, 0, headers, data


class RawRangeReader:
    """Reads [first, end] from EXO_EVENTS through a push consumer whose messages arrive raw."""

    MAX_RESTARTS = 10  # consumers recreated without progress before the read gives up

    def __init__(self, nc: Client, reader_nc: Client, on_batch: OnBatch, first: int, end: int, headers: HeaderMode,
                 names: LogNames = SHARED) -> None:
        self._names = names
        self._js = nc.jetstream()  # consumers are created and deleted over the caller's connection
        self._nc = reader_nc
        self._parser: RawParser = reader_nc._ps  # type: ignore[assignment]  # installed by RawParser.install
        self._on_batch = on_batch
        self._first = first
        self._next = first  # the lowest stream sequence still to deliver
        self._end = end
        self._headers = headers
        self._done = asyncio.Event()  # read to the end, or failed (then `error` says why)
        self._restart = asyncio.Event()  # this consumer lost a message or went away: make a new one
        self._wake = asyncio.Event()  # either of them happened
        self._consumer = ""
        self._subscription: Subscription | None = None
        self._next_cseq = 1  # the consumer sequence the next data message must have
        self._subjects: dict[bytes, str] = {}
        self.delivered = 0
        self.error: BaseException | None = None

    async def run(self, stall_timeout: float) -> int:
        self._parser.on_raw = self._on_raw
        restarts, progress = 0, -1
        try:
            await self._start()
            while not self._done.is_set():
                seen = self.delivered
                try:
                    await asyncio.wait_for(self._wake.wait(), stall_timeout)
                except TimeoutError:
                    if self.delivered == seen:
                        raise BusError(f"the event stream stopped sending after {seen} events "
                                       f"({stall_timeout} s without one)") from None
                    continue
                self._wake.clear()
                if self._restart.is_set() and not self._done.is_set():
                    restarts = 0 if self.delivered != progress else restarts + 1
                    progress = self.delivered
                    if restarts >= self.MAX_RESTARTS:
                        raise BusError(f"the event stream's consumer failed {restarts} times at sequence {self._next}")
                    await self._start()
        finally:
            await self._stop()
            self._parser.on_raw = None
        if self.error is not None:
            raise self.error
        return self.delivered

    async def _start(self) -> None:
        """A new push consumer from the next sequence to deliver, on a new inbox."""
        await self._stop()
        self._restart.clear()
        self._next_cseq = 1
        inbox = self._nc.new_inbox()
        subscription = self._subscription = await self._nc.subscribe(inbox, cb=self._not_raw)
        self._parser.set_raw_sid(subscription._id)
        await self._nc.flush()  # the server knows the inbox before the consumer sends to it
        config = api.ConsumerConfig(
            deliver_subject=inbox, deliver_policy=api.DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=self._next,
            filter_subject=self._names.all_events, ack_policy=api.AckPolicy.NONE, max_deliver=1, flow_control=True,
            idle_heartbeat=HEARTBEAT_S, mem_storage=True, num_replicas=1, inactive_threshold=30.0,
        )
        self._consumer = (await self._js.add_consumer(self._names.events_stream, config=config)).name

    async def _stop(self) -> None:
        subscription, self._subscription = self._subscription, None
        self._parser.set_raw_sid(None)  # what is still on its way to the old inbox is dropped
        if subscription is not None:
            await unsubscribe_quietly(subscription)
        if self._consumer:
            consumer, self._consumer = self._consumer, ""
            with contextlib.suppress(Exception):  # gone already, or the server goes away: it expires on its own
                await self._js.delete_consumer(self._names.events_stream, consumer)

    async def _not_raw(self, msg: Msg) -> None:
        if self._subscription is not None and msg.sid == self._subscription._id:  # cannot happen; never silently
            self._fail(BusError("a message for the raw reader went through nats-py's parser"))

    def _fail(self, error: BaseException) -> None:
        if self.error is None:
            self.error = error
        self._finish()

    def _finish(self) -> None:
        self._done.set()
        self._wake.set()

    def _ask_restart(self) -> None:
        self._restart.set()
        self._wake.set()

    async def _on_raw(self, batch: list[RawMessage]) -> None:
        try:
            for reply in self._take(batch):
                await self._nc.publish(reply)
        except Exception as error:  # must not reach nats-py's read loop: it would stop reading
            self._fail(error)

    def _take(self, batch: list[RawMessage]) -> list[str]:
        """Deliver the batch's records; returns the flow control subjects to answer, after."""
        if self._done.is_set() or self._restart.is_set():
            return []  # past the end, failed, or a consumer being replaced: drop the rest
        records: list[LogRecord] = []
        replies: list[str] = []
        subjects, with_headers = self._subjects, self._headers
        for subject, reply, seq, cseq, time_ns, headers, data in batch:
            if not seq:
                self._status(headers, reply, replies)
                if self._restart.is_set():
                    break
                continue
            if cseq != self._next_cseq:  # the server lost one for us: start again from the next one
                self._ask_restart()
                break
            self._next_cseq = cseq + 1
            if seq < self._next:
                continue
            if self.delivered == 0 and not records and seq > self._first:
                # The head aged out between our look at the stream and the consumer.
                self._fail(LogGap(f"the event stream starts at sequence {seq}; sequences from {self._first} are gone"))
                return []
            if seq > self._end:
                self._finish()
                break
            self._next = seq + 1
            name = subjects.get(subject)
            if name is None:
                name = subjects[subject] = subject.decode()
            records.append(LogRecord(seq=seq, subject=name, time_ns=time_ns,
                                     headers=headers_of(headers) if with_headers is True
                                     or (with_headers == SIGNED and _SIGNATURE in headers) else None, data=data))
            if seq == self._end:
                self._finish()
                break
        if records:
            try:
                self._on_batch(records)
            except Exception as error:  # handed back to the caller of read_log
                self._fail(error)
                return []
            self.delivered += len(records)
        return replies

    def _status(self, headers: bytes, reply: bytes, replies: list[str]) -> None:
        """An idle heartbeat or a flow control request (status 100); anything else (the
        consumer was deleted, say) means starting again from the next sequence."""
        status_line, _, rest = headers.partition(b"\r\n")
        if status_line[9:12] != b"100":
            self._ask_restart()
            return
        if reply:  # "FlowControl Request": answer once what came before it is delivered
            replies.append(reply.decode())
            return
        fields = headers_of(b"NATS/1.0\r\n" + rest) or {}
        if stalled := fields.get("Nats-Consumer-Stalled"):
            replies.append(stalled)
        last = fields.get("Nats-Last-Consumer")
        if last is not None and int(last) >= self._next_cseq:  # it sent more than we got
            self._ask_restart()


def headers_of(raw: bytes) -> dict[str, str] | None:
    """A stored message's headers (`NATS/1.0\\r\\nName: value\\r\\n...\\r\\n`) exactly as nats-py's
    Msg.headers has them (Client._parse_header_lines), with the names' checks done once per name."""
    if not raw:
        return None
    headers = {}
    for line in raw[_HEADER_LINE_SIZE:].split(b"\r\n"):
        name, colon, value = line.partition(b":")
        if not colon:
            continue
        if name in _header_names:
            key = _header_names[name]
        else:
            key = _header_name(name)
            if len(_header_names) < 1000:
                _header_names[name] = key
        if key is not None:
            headers[key] = value.strip().decode("utf-8", "replace")
    return headers or None


def _header_name(name: bytes) -> str | None:
    """nats-py's rule: ASCII, no whitespace inside; None for a line it ignores."""
    try:
        key = name.strip().decode("ascii")
    except UnicodeDecodeError:
        return None
    return None if any(c.isspace() for c in key) else key


_HEADER_LINE_SIZE = len(b"NATS/1.0\r\n")
_header_names: dict[bytes, str | None] = {}


def _msg_args(line: bytes, is_hmsg: bool) -> tuple[bytes, bytes, bytes, int, int]:
    """A MSG / HMSG control line after its verb: subject, sid, reply, header size, total size."""
    args = line.split()
    try:
        if is_hmsg:
            return args[0], args[1], args[2] if len(args) == 5 else b"", int(args[-2]), int(args[-1])
        return args[0], args[1], args[2] if len(args) == 4 else b"", 0, int(args[-1])
    except (IndexError, ValueError):
        raise ProtocolError("nats: malformed MSG") from None
