"""The raw event-log reader (exo.bus.tooling.log_reader): its protocol parser takes every message of
its subscription the way nats-py's parser would have delivered it, however the bytes are cut
into socket reads, and leaves everything else to nats-py; against a real server it reads
exactly what nats-py's ordered consumer reads, stops where asked, reports a trimmed head, and
starts a new consumer from the next sequence when a message goes missing."""

from __future__ import annotations

import asyncio
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from nats.protocol.parser import Parser

from exo.bus.connection import connect
from exo.bus.errors import LogGap
from exo.bus.event_log import EventLog
from exo.bus.provision import provision
from exo.bus.subjects import EVENTS_STREAM
from exo.bus.tooling import log_reader
from exo.bus.tooling.log_reader import LogRecord, read_log, read_log_batches, read_log_ordered
from exo.bus.tooling.raw_reader import RawParser, RawRangeReader, headers_of
from exo.core.events import TaskStarted

# ---- the parser, without a server ------------------------------------------------------------


class FakeClient:
    """What a parser calls on nats-py's Client, recorded."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    async def _process_msg(self, sid, subject, reply, data, headers) -> None:
        self.calls.append(("msg", sid, bytes(subject), bytes(reply), bytes(data), headers and bytes(headers)))

    async def _process_ping(self) -> None:
        self.calls.append(("ping",))

    async def _process_pong(self) -> None:
        self.calls.append(("pong",))

    async def _process_info(self, info) -> None:
        self.calls.append(("info", info))

    async def _process_err(self, message) -> None:
        self.calls.append(("err", message))


RAW_SID = 7


def stored(seq: int, payload: bytes, headers: bytes = b"NATS/1.0\r\nNats-Msg-Id: id-%d\r\n\r\n") -> bytes:
    headers = headers.replace(b"%d", str(seq).encode())
    reply = b"$JS.ACK.EXO_EVENTS.c0nsumer.1.%d.%d.17331400000%08d.0" % (seq, seq, seq)
    return b"HMSG exo.events.task.started %d %s %d %d\r\n%s%s\r\n" % (
        RAW_SID, reply, len(headers), len(headers) + len(payload), headers, payload)


HEARTBEAT_HEADERS = b"NATS/1.0 100 Idle Heartbeat\r\nNats-Last-Consumer: 3\r\nNats-Last-Stream: 3\r\n\r\n"
FLOW_CONTROL_HEADERS = b"NATS/1.0 100 FlowControl Request\r\n\r\n"
DOMAIN_REPLY = b"$JS.ACK.hub.ACCHASH.EXO_EVENTS.c0nsumer.1.4.4.1733140000000000004.0.RANDOM"
# A session as the server might send it: our stored messages (one with an empty payload, one
# whose payload looks like protocol), status messages, another subscription's messages,
# and the protocol lines nats-py handles.
WIRE = b"".join([
    b'INFO {"server_id":"x","max_payload":1048576}\r\n',
    b"+OK\r\n",
    stored(1, b'{"kind":"task.started","task_id":"a"}'),
    b"PING\r\n",
    stored(2, b"garbage\r\nHMSG not.a.message 7 1 2\r\n"),
    b"MSG _INBOX.other 3 _INBOX.reply 5\r\nhello\r\n",
    b"HMSG _INBOX.deliver %d %d %d\r\n%s\r\n" % (RAW_SID, len(HEARTBEAT_HEADERS), len(HEARTBEAT_HEADERS),
                                                 HEARTBEAT_HEADERS),
    stored(3, b"", headers=b"NATS/1.0\r\nNats-Msg-Id: empty\r\n\r\n"),
    b"HMSG _INBOX.deliver %d $JS.FC.EXO_EVENTS.x.y %d %d\r\n%s\r\n" % (
        RAW_SID, len(FLOW_CONTROL_HEADERS), len(FLOW_CONTROL_HEADERS), FLOW_CONTROL_HEADERS),
    b"HMSG exo.events.task.finished %d %s 12 14\r\nNATS/1.0\r\n\r\n{}\r\n" % (RAW_SID, DOMAIN_REPLY),
    b"HMSG _INBOX.other 3 18 23\r\nNATS/1.0\r\nA: b\r\n\r\nhello\r\n",
    b"MSG exo.events.no.headers %d 7\r\n{\"a\":1}\r\n" % RAW_SID,
    b"PONG\r\n",
    b"INFO %s\r\n" % json.dumps({"connect_urls": [f"10.0.{n // 250}.{n % 250}:4222" for n in range(400)]}).encode(),
    b"-ERR 'Stale Connection'\r\n",
])


async def parse_in_pieces(wire: bytes, cuts: list[int]) -> tuple[list, list]:
    client = FakeClient()
    parser = RawParser(client)
    parser.set_raw_sid(RAW_SID)
    delivered = []

    async def on_raw(batch):
        delivered.extend(batch)

    parser.on_raw = on_raw
    bounds = [0, *sorted(set(cuts)), len(wire)]
    for start, stop in zip(bounds, bounds[1:]):
        await parser.parse(wire[start:stop])
    assert not parser.buf
    return delivered, client.calls


def test_the_parser_hands_over_its_subscription_and_leaves_the_rest_to_nats_py():
    delivered, calls = asyncio.run(parse_in_pieces(WIRE, []))
    assert [m[2] for m in delivered] == [1, 2, 0, 3, 0, 4, 0]  # stream sequences; 0: not a stored message
    first, garbage, heartbeat, empty, flow, domain, bare = delivered
    assert first == (b"exo.events.task.started", b"", 1, 1, 1733140000000000001,
                     b"NATS/1.0\r\nNats-Msg-Id: id-1\r\n\r\n", b'{"kind":"task.started","task_id":"a"}')
    assert garbage[6] == b"garbage\r\nHMSG not.a.message 7 1 2\r\n"
    assert heartbeat[1] == b"" and heartbeat[5] == HEARTBEAT_HEADERS and heartbeat[6] == b""
    assert empty[6] == b"" and empty[5].endswith(b"empty\r\n\r\n")
    assert flow[1] == b"$JS.FC.EXO_EVENTS.x.y" and flow[5] == FLOW_CONTROL_HEADERS
    assert domain[:5] == (b"exo.events.task.finished", b"", 4, 4, 1733140000000000004) and domain[6] == b"{}"
    assert bare == (b"exo.events.no.headers", b"", 0, 0, 0, b"", b'{"a":1}')

    # Everything else reaches nats-py exactly as its own parser hands it over.
    plain_client = FakeClient()
    plain = Parser(plain_client)
    asyncio.run(plain.parse(WIRE))
    assert calls == [call for call in plain_client.calls if call[0] != "msg" or call[1] != RAW_SID]
    assert [c[0] for c in calls] == ["info", "ping", "msg", "msg", "pong", "info", "err"]
    assert len(calls[5][1]["connect_urls"]) == 400  # a line longer than nats-py's 4,096 bytes


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, len(WIRE) - 1), max_size=12))
def test_how_the_bytes_are_cut_into_reads_changes_nothing(cuts: list[int]):
    assert asyncio.run(parse_in_pieces(WIRE, cuts)) == asyncio.run(parse_in_pieces(WIRE, []))


def test_without_a_subscription_it_is_nats_pys_parser():
    client = FakeClient()
    parser = RawParser(client)
    asyncio.run(parser.parse(WIRE))
    plain_client = FakeClient()
    asyncio.run(Parser(plain_client).parse(WIRE))
    assert client.calls == plain_client.calls


@pytest.mark.parametrize("raw", [
    b"", b"NATS/1.0\r\nNats-Msg-Id: abc\r\n\r\n", b"NATS/1.0\r\nNats-Msg-Id:a:b \r\n\r\n",
    b"NATS/1.0\r\nNats-Msg-Id: a\r\nX-Other: y z\r\n\r\n", b"NATS/1.0\r\nNats-Msg-Id: \xff\r\n\r\n",
    b"NATS/1.0\r\nBad Name: c\r\n\r\n", b"NATS/1.0\r\n\r\n", b"NATS/1.0\r\n: nameless\r\nno colon\r\n\r\n",
    b"NATS/1.0\r\nNats-Msg-Id: a\r\nNats-Expected-Stream: EXO_EVENTS\r\n\r\n", b"NATS/1.0\r\nK\xc3\xa9y: v\r\n\r\n",
    b"NATS/1.0\r\n A :  padded  \r\nA: again\r\n\r\n",
])
def test_headers_read_as_nats_py_reads_them(raw: bytes):
    from nats.aio.client import Client

    expected = (Client._parse_header_lines(raw[len(b"NATS/1.0\r\n"):]) or None) if raw else None
    assert headers_of(raw) == expected


# ---- against a real server -------------------------------------------------------------------


@pytest.fixture
async def log_nc(fresh_nats: str):
    """A fresh server whose log holds exo events, events with other headers, a payload that
    is not JSON and one published without any header."""
    nc = await connect([fresh_nats], name="test-raw-reader")
    await provision(nc)
    log, js = EventLog(nc), nc.jetstream()
    for n in range(300):
        await log.append(TaskStarted(task_id=f"t{n}"), event_id=f"e{n}")
    await js.publish("exo.events.task.started", b"not json {", stream=EVENTS_STREAM)
    await js.publish("exo.events.task.started", json.dumps({"kind": "task.started"}, indent=2).encode(),
                     stream=EVENTS_STREAM, headers={"Nats-Msg-Id": "pretty", "X-Why": "a test: yes"})
    await nc.publish("exo.events.card.added", b"{}")  # core publish: stored without headers
    await nc.flush()
    while (await log_reader.log_bounds(nc)).last_seq < 303:
        await asyncio.sleep(0.01)
    yield nc
    await nc.close()


def _fields(records: list[LogRecord]) -> list[tuple]:
    return [(r.seq, r.subject, r.time_ns, r.headers, r.data) for r in records]


async def _read(reader, nc, **kwargs) -> list[LogRecord]:
    records: list[LogRecord] = []
    await reader(nc, records.extend, **kwargs)
    return records


async def _consumers(nc) -> int:
    return (await nc.jetstream().stream_info(EVENTS_STREAM)).state.consumer_count


async def test_the_raw_reader_reads_what_nats_pys_ordered_consumer_reads(log_nc):
    raw = await _read(read_log_batches, log_nc)
    assert [r.seq for r in raw] == list(range(1, 304))
    assert await _consumers(log_nc) == 0  # a read deletes its consumer
    assert raw[0].headers == {"Nats-Msg-Id": "e0", "Nats-Expected-Stream": EVENTS_STREAM}
    assert raw[0].subject == "exo.events.task.started"
    assert raw[301].headers == {"Nats-Msg-Id": "pretty", "X-Why": "a test: yes", "Nats-Expected-Stream": EVENTS_STREAM}
    assert raw[300].data == b"not json {" and raw[302].headers is None and raw[302].data == b"{}"
    assert all(r.headers is None for r in await _read(read_log_batches, log_nc, headers=False))
    one_by_one: list[LogRecord] = []
    assert await read_log(log_nc, one_by_one.append, first_seq=120, last_seq=130) == 11
    assert _fields(one_by_one) == _fields(raw[119:130])
    assert await _read(read_log_batches, log_nc, first_seq=304) == []
    assert _fields(raw) == _fields(await _read(read_log_ordered, log_nc))


async def test_a_callback_that_raises_ends_the_read(log_nc):
    seen: list[int] = []

    def on_record(record: LogRecord) -> None:
        seen.append(record.seq)
        if record.seq == 150:
            raise ValueError("enough")

    with pytest.raises(ValueError, match="enough"):
        await read_log(log_nc, on_record)
    assert seen == list(range(1, 151))
    assert await _consumers(log_nc) == 0


async def test_a_trimmed_head_is_a_log_gap(log_nc):
    await log_nc.jetstream().purge_stream(EVENTS_STREAM, seq=100)
    with pytest.raises(LogGap, match="starts at sequence 100; sequences from 1 are gone"):
        await _read(read_log_batches, log_nc)
    assert [r.seq for r in await _read(read_log_batches, log_nc, first_seq=100)] == list(range(100, 304))


async def test_a_lost_message_starts_a_new_consumer_from_the_next_sequence(log_nc, monkeypatch):
    """The server never drops for a consumer with flow control, but a slow-consumer disconnect
    can: a message missing from the consumer's sequence makes the reader start over from the
    next stream sequence, and nothing is delivered twice or skipped."""
    dropped = []
    take = RawRangeReader._take

    def losing_one(self, batch):
        stored = [m for m in batch if m[2]]
        if not dropped and stored and stored[0][2] >= 50:
            dropped.append(stored[0][2])
            batch = [m for m in batch if m is not stored[0]]
        return take(self, batch)

    monkeypatch.setattr(RawRangeReader, "_take", losing_one)
    raw = await _read(read_log_batches, log_nc)
    assert dropped and [r.seq for r in raw] == list(range(1, 304))
    assert await _consumers(log_nc) == 0


def test_nats_py_still_has_the_private_parts_the_raw_reader_uses():
    """pyproject pins nats-py to the minor version this was written against; if an upgrade
    moves these, this fails loudly rather than the raw reader misreading the log."""
    import inspect

    from nats.aio.client import Client
    from nats.protocol import parser

    client = Client()
    assert type(client._ps) is Parser and client._ps.state == parser.AWAITING_CONTROL_LINE and client._subs == {}
    assert list(inspect.signature(Client._process_msg).parameters) == ["self", "sid", "subject", "reply", "data", "headers"]
    assert list(inspect.signature(Client._process_err).parameters) == ["self", "err_msg"]
    for name in ("AWAITING_CONTROL_LINE", "ERR_RE", "INFO_RE", "OK_RE", "PING_RE", "PONG_RE"):
        assert hasattr(parser, name), name
    assert RawParser.install(client)  # and it takes the place of that parser
