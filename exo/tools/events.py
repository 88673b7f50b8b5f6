"""`exo events`: the event log as an operator reads it.

    exo events tail [--since SEQ | --last N] [--filter KEY=VALUE]... [--count N] [--json]
        follow the log live, one readable line per event (--json: export lines)
    exo events export [--from SEQ] [--until SEQ] [-o FILE]
        JSON Lines, one event per line with its sequence, subject, time and headers;
        `exo replay --file FILE` replays it offline
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from typing import BinaryIO

import msgspec

from exo.bus.chunk_signing import message_check
from exo.bus.tooling.log_reader import LogFollower, LogRecord, log_bounds, read_log
from exo.core.apply import apply
from exo.core.events import AnyEvent, decode_event
from exo.core.state import State
from exo.tools.cli import EXIT_OK, Output, add_nats_option, open_nats, run_tool
from exo.tools.event_view import EventFilter, describe, kind_of, matches, parse_filters
from exo.tools.export_format import encode_line
from exo.tools.render import step_text
from exo.tools.replay_fold import Step


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="exo events", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    tail = commands.add_parser("tail", help="follow the event log live, one line per event")
    add_nats_option(tail)
    start = tail.add_mutually_exclusive_group()
    start.add_argument("--since", type=int, metavar="SEQ", help="start at this sequence (default: new events only)")
    start.add_argument("--last", type=int, metavar="N", help="start with the last N events")
    tail.add_argument("--filter", action="append", default=[], metavar="KEY=VALUE",
                      help="only events matching: kind=PATTERN, node=ID, instance=ID, command=ID")
    tail.add_argument("--count", type=int, metavar="N", help="exit after showing N events")
    tail.add_argument("--json", action="store_true", help="print export lines (JSON) instead of text")
    export = commands.add_parser("export", help="write the event log as JSON Lines")
    add_nats_option(export)
    export.add_argument("--from", dest="from_seq", type=int, default=1, metavar="SEQ")
    export.add_argument("--until", type=int, metavar="SEQ")
    export.add_argument("-o", "--output", help="file to write (default: stdout)")
    args = parser.parse_args(argv)
    if args.command == "tail":
        try:
            args.event_filter = parse_filters(args.filter)
        except ValueError as error:
            tail.error(str(error))
    return args


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    return run_tool("events", _tail(args) if args.command == "tail" else _export(args))


async def _export(args: argparse.Namespace) -> int:
    nc = await open_nats(args, "events-export")
    try:
        bounds = await log_bounds(nc)
        first = max(args.from_seq, bounds.first_seq, 1)
        if bounds.first_seq > args.from_seq:
            print(f"exo events: the log now starts at sequence {bounds.first_seq}", file=sys.stderr)
        sink = await asyncio.to_thread(_open_output, args.output) if args.output else sys.stdout.buffer
        try:
            count = await read_log(nc, lambda record: None if sink.write(encode_line(record)) else None, first, args.until)
        finally:
            sink.flush()
            if args.output:
                sink.close()
    finally:
        await nc.close()
    print(f"exo events: exported {count} events", file=sys.stderr)
    return EXIT_OK


def _open_output(path: str) -> BinaryIO:
    return open(path, "wb")  # _export closes it


class _Tail:
    """Prints matching events as they arrive. It folds what it sees into a State of its own,
    so `--filter instance=ID` also finds task.started / task.finished of that instance's tasks."""

    def __init__(self, out: Output, event_filter: EventFilter, as_json: bool, count: int | None) -> None:
        self.done = asyncio.Event()
        self._out = out
        self._filter = event_filter
        self._as_json = as_json
        self._left = count
        self._context = State()
        self.reader_left = False

    def on_record(self, record: LogRecord) -> None:
        if self.done.is_set():
            return
        try:
            event, reason = decode_event(record.data), ""
        except (msgspec.DecodeError, msgspec.ValidationError) as error:
            event, reason = None, f"undecodable: {error}"
        kind = kind_of(record.subject, event)
        shown = matches(self._filter, kind, event, self._context)
        if event is not None:
            self._context = apply(self._context, event, record.seq, message_check(record.subject, record.data, record.headers))
        if shown:
            self._show(record, kind, event, reason)

    def _show(self, record: LogRecord, kind: str, event: AnyEvent | None, reason: str) -> None:
        try:
            if self._as_json:
                self._out.raw(encode_line(record))
            else:
                summary = describe(event) if event is not None else ""
                self._out.line(step_text(Step(seq=record.seq, time_ns=record.time_ns, kind=kind, summary=summary,
                                              skipped=reason)))
            self._out.flush()
        except BrokenPipeError:  # `exo events tail | head`: the reader left, so do we
            self.reader_left = True
            self.done.set()
            return
        if self._left is not None:
            self._left -= 1
            if self._left <= 0:
                self.done.set()


async def _tail(args: argparse.Namespace) -> int:
    nc = await open_nats(args, "events-tail")
    tail = _Tail(Output(), args.event_filter, args.json, args.count)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, tail.done.set)
    follower = LogFollower(nc, tail.on_record)
    try:
        last = (await log_bounds(nc)).last_seq
        # By sequence, not DeliverPolicy "new": --last N and the default mean the same thing.
        start = args.since if args.since is not None else last + 1 - (args.last or 0)
        await follower.start(max(start, 1))
        await tail.done.wait()
    finally:
        await follower.stop()
        await nc.close()
    if tail.reader_left:
        raise BrokenPipeError  # run_tool makes this a quiet, successful exit
    return EXIT_OK
