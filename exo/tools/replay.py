"""`exo replay`: rebuild State from the event log with the reducer every node uses.

    exo replay                              State now, from the live stream (--nats URL)
    exo replay --file events.jsonl          ... from an `exo events export` file, offline
    exo replay --until 1200                 State as of sequence 1200
    exo replay --from-snapshot              start from the latest snapshot (at or before --until)
    exo replay --diff --filter kind=task.*  per event: what it changed in State
    exo replay --list --filter instance=ID  per event: one line
    exo replay --verify                     compare with every snapshot the KV bucket keeps
    exo replay --group chat                 master group chat's log (its own sequences and snapshots)
    exo replay --all-groups                 the shared log and every group's: the cluster State
    ... --json                              JSON Lines: one object per listed event, then the result

Events that do not decode, that the reducer skips, or that are missing are listed with their
sequence and reason; they never stop the replay. Exit 1 when --verify finds a disagreement.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Iterable
from typing import Any

import msgspec

from exo.bus.chunk_signing import message_check
from exo.bus.subjects import group_names
from exo.bus.tooling.log_reader import LogRecord, log_bounds, read_log_batches
from exo.bus.tooling.raw_reader import SIGNED
from exo.bus.tooling.snapshot_reader import StoredSnapshot, stored_snapshots
from exo.core.apply import fold_into
from exo.core.draft import Draft
from exo.core.events import decode_event
from exo.core.groups import GROUP_NAME, for_cluster
from exo.core.state import SkippedEvent, State, decode_state
from exo.tools.cli import EXIT_FAILED, EXIT_OK, Output, ToolError, add_nats_option, open_nats, run_tool
from exo.tools.event_view import parse_filters
from exo.tools.export_format import read_lines
from exo.tools.render import check_text, skipped_text, step_json, step_text
from exo.tools.replay_fold import Checkpoint, Replayer


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="exo replay", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_nats_option(parser)
    parser.add_argument("--file", help="replay a JSON Lines export (`exo events export`) instead; - for stdin")
    parser.add_argument("--until", type=int, metavar="SEQ", help="stop after this sequence")
    parser.add_argument("--from-snapshot", action="store_true",
                        help="start from the latest stored snapshot at or before --until")
    parser.add_argument("--verify", action="store_true",
                        help="replay from the start and compare with every stored snapshot")
    parser.add_argument("--diff", action="store_true", help="print what each event changed in State")
    parser.add_argument("--list", action="store_true", help="print one line per event")
    parser.add_argument("--filter", action="append", default=[], metavar="KEY=VALUE",
                        help="only show events matching: kind=PATTERN, node=ID, instance=ID, command=ID")
    parser.add_argument("--json", action="store_true", help="machine-readable output (JSON Lines)")
    parser.add_argument("--group", default="", metavar="NAME", help="replay master group NAME's log (EXO_MASTER_GROUPS)")
    parser.add_argument("--all-groups", action="store_true",
                        help="replay the shared log, then every master group's it names, into the cluster's State")
    args = parser.parse_args(argv)
    if args.group and not GROUP_NAME.fullmatch(args.group):
        parser.error(f"--group {args.group[:64]!r}: a group name is a lowercase letter, then a-z, 0-9, _ and -")
    if args.all_groups and (args.group or args.file or args.until is not None or args.verify or args.from_snapshot):
        parser.error("--all-groups replays every log to its end: it takes no --group, --file, --until, --verify "
                     "or --from-snapshot")
    try:
        args.event_filter = parse_filters(args.filter)
    except ValueError as error:
        parser.error(str(error))
    if args.file and (args.from_snapshot or args.verify):
        parser.error("--from-snapshot and --verify read snapshots from NATS; they do not combine with --file")
    if args.verify and (args.from_snapshot or args.until is not None):
        parser.error("--verify replays the whole log; it does not combine with --from-snapshot or --until")
    args.per_event = args.diff or args.list or bool(args.filter)
    return args


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    return run_tool("replay", _replay(args))


async def _replay(args: argparse.Namespace) -> int:
    out = Output()
    started = time.perf_counter()
    if args.file:
        from_file = _new_replayer(args, out, State(group=args.group))
        _fold_file(args.file, from_file, args.until)
        replayer: Replayer = from_file
        unreadable: list[str] = []
    else:
        replayer, unreadable = await _fold_stream(args, out)
    if args.all_groups:
        await _fold_groups(args, out, replayer)
    elapsed = time.perf_counter() - started
    code = _report(args, out, replayer, unreadable)
    out.flush()
    _summary(replayer, elapsed)
    return code


class BatchReplayer(Replayer):
    """A Replayer that also takes records many at a time. With nothing to show per event (no
    --list, --diff or --filter) a batch goes through one `Draft` of State (exo.core.draft), so
    each part of State is copied once per batch, not once per event; the State is taken at the
    end of the batch and at every checkpoint in it. Same State, same skipped list, same checks
    as `feed` one record at a time."""

    def feed_all(self, records: Iterable[LogRecord]) -> None:
        if self._on_step is not None:
            for record in records:
                self.feed(record)
            return
        draft, last, checkpoints = Draft(self.state), self.state.last_seq, self._checkpoints
        for record in records:
            seq = record.seq
            if seq <= last:
                continue  # already folded in (a snapshot covers it, or a reader sent it twice)
            if seq > last + 1:
                missing = f"sequence {last + 1}" if last + 1 == seq - 1 else f"sequences {last + 1}-{seq - 1}"
                self.skipped.append(SkippedEvent(seq=last + 1, reason=f"{missing} missing from the log"))
            try:
                event = decode_event(record.data)
            except (msgspec.DecodeError, msgspec.ValidationError) as error:
                reason = f"undecodable event on {record.subject}: {error}"
                draft.skip(seq, reason)
            else:
                reason = fold_into(draft, event, seq, message_check(record.subject, record.data, record.headers))
            if reason:
                self.skipped.append(SkippedEvent(seq=seq, reason=reason))
            self.replayed += 1
            last = seq
            if seq in checkpoints:
                self.state = draft.state()
                self._check(seq)
        self.state = draft.state()


_FILE_BATCH = 1000  # export lines folded per batch


def _new_replayer(args: argparse.Namespace, out: Output, state: State,
                  checkpoints: list[Checkpoint] | None = None) -> BatchReplayer:
    on_step = None
    if args.per_event:
        on_step = (lambda step: out.raw(step_json(step) + b"\n")) if args.json else (lambda step: out.line(step_text(step)))
    return BatchReplayer(state, on_step=on_step, event_filter=args.event_filter, diff=args.diff,
                         checkpoints=checkpoints or [])


def _fold_file(path: str, replayer: BatchReplayer, until: int | None) -> None:
    source = sys.stdin.buffer if path == "-" else open(path, "rb")  # noqa: SIM115  # the with below
    with source:
        batch: list[LogRecord] = []
        for record in read_lines(source, "stdin" if path == "-" else path):
            if until is not None and record.seq > until:
                break
            batch.append(record)
            if len(batch) == _FILE_BATCH:
                replayer.feed_all(batch)
                batch = []
        replayer.feed_all(batch)


async def _fold_stream(args: argparse.Namespace, out: Output) -> tuple[Replayer, list[str]]:
    nc = await open_nats(args, "replay")
    names = group_names(args.group)
    try:
        snapshots = await stored_snapshots(nc, names) if (args.verify or args.from_snapshot) else []
        checkpoints, unreadable = _decode_snapshots(snapshots)
        empty = start = State(group=args.group)
        if args.from_snapshot:
            start = _latest_at_or_before([c.state for c in checkpoints], args.until, empty)
        if args.verify:
            start, checkpoints = _verify_start(checkpoints, (await log_bounds(nc, names)).first_seq, empty)
        replayer = _new_replayer(args, out, start, checkpoints if args.verify else [])
        await read_log_batches(nc, replayer.feed_all, first_seq=start.last_seq + 1, last_seq=args.until,
                               headers=SIGNED, names=names)
    finally:
        await nc.close()
    return replayer, unreadable


async def _fold_groups(args: argparse.Namespace, out: Output, shared: Replayer) -> None:
    """Every group log the shared State names, each folded on its own, laid over the shared State."""
    nc = await open_nats(args, "replay")
    groups: list[State] = []
    try:
        for group in shared.state.group_logs:
            replayer = _new_replayer(args, out, State(group=group))
            await read_log_batches(nc, replayer.feed_all, headers=SIGNED, names=group_names(group))
            shared.replayed += replayer.replayed
            shared.skipped += [SkippedEvent(seq=s.seq, reason=f"group {group}: {s.reason}") for s in replayer.skipped]
            groups.append(replayer.state)
    finally:
        await nc.close()
    shared.state = for_cluster(shared.state, groups)


def _decode_snapshots(snapshots: list[StoredSnapshot]) -> tuple[list[Checkpoint], list[str]]:
    checkpoints, unreadable = [], []
    for snapshot in snapshots:
        try:
            checkpoints.append(Checkpoint(revision=snapshot.revision, state=decode_state(snapshot.value)))
        except (msgspec.DecodeError, msgspec.ValidationError) as error:
            unreadable.append(f"snapshot revision {snapshot.revision} is not a State: {error}")
    return checkpoints, unreadable


def _verify_start(checkpoints: list[Checkpoint], first_seq: int, empty: State) -> tuple[State, list[Checkpoint]]:
    """Verify from sequence 1 if the log still starts there; otherwise from the oldest kept
    snapshot the log continues (it is trusted, the later ones are checked against it)."""
    if first_seq <= 1:
        return empty, checkpoints
    reachable = [c for c in checkpoints if c.state.last_seq >= first_seq - 1]
    if not reachable:
        raise ToolError(f"the event stream starts at sequence {first_seq} and no kept snapshot reaches it: "
                        f"there is nothing to verify against")
    base = reachable[0]
    print(f"exo replay: the event stream starts at sequence {first_seq}: verifying from snapshot revision "
          f"{base.revision} (sequence {base.state.last_seq}); {len(checkpoints) - len(reachable)} older snapshot(s) "
          f"not checked", file=sys.stderr)
    return base.state, reachable[1:]


def _latest_at_or_before(states: list[State], until: int | None, empty: State) -> State:
    usable = [s for s in states if until is None or s.last_seq <= until]
    if not usable:
        print("exo replay: no stored snapshot" + (f" at or before {until}" if until is not None else "")
              + "; replaying from the start", file=sys.stderr)
        return empty
    return max(usable, key=lambda s: s.last_seq)


def _report(args: argparse.Namespace, out: Output, replayer: Replayer, unreadable: list[str]) -> int:
    if args.verify:
        return _report_verify(args, out, replayer, unreadable)
    for problem in unreadable:  # --from-snapshot passed over it
        print(f"exo replay: {problem}", file=sys.stderr)
    if args.json:
        result = {"type": "result", **_result_fields(replayer), "state": msgspec.to_builtins(replayer.state)}
        out.raw(msgspec.json.encode(result) + b"\n")
        return EXIT_OK
    for line in skipped_text(replayer.skipped):
        out.line(line)
    if not args.per_event:
        out.line(f"State as of sequence {replayer.state.last_seq}:")
        out.raw(msgspec.json.format(msgspec.json.encode(replayer.state), indent=2) + b"\n")
    return EXIT_OK


def _report_verify(args: argparse.Namespace, out: Output, replayer: Replayer, unreadable: list[str]) -> int:
    unreached = [f"snapshot revision {c.revision} covers sequence {c.state.last_seq}, "
                 f"but the log ends at {replayer.state.last_seq}" for c in replayer.unreached_checkpoints]
    differing = [c for c in replayer.checks if not c.agrees]
    problems = [*unreadable, *unreached]
    agrees = not differing and not problems
    if args.json:
        result = {"type": "verify", **_result_fields(replayer), "agrees": agrees,
                  "checks": [msgspec.to_builtins(c) for c in replayer.checks], "problems": problems}
        out.raw(msgspec.json.encode(result) + b"\n")
        return EXIT_OK if agrees else EXIT_FAILED
    for line in skipped_text(replayer.skipped):
        out.line(line)
    for check in replayer.checks:
        out.line(check_text(check))
    for problem in problems:
        out.line(problem)
    if not replayer.checks and not problems:
        out.line("verify: no stored snapshots to compare with")
    elif agrees:
        out.line(f"verify: all {len(replayer.checks)} snapshot(s) agree with the replay")
    elif differing:
        first = differing[0]
        out.line(f"verify: FAILED: the replay first diverges from a snapshot at sequence {first.seq}, at {first.path}")
    else:
        out.line("verify: FAILED: " + problems[0])
    return EXIT_OK if agrees else EXIT_FAILED


def _result_fields(replayer: Replayer) -> dict[str, Any]:
    return {"from_seq": replayer.start_seq, "last_seq": replayer.state.last_seq, "replayed": replayer.replayed,
            "skipped": [msgspec.to_builtins(s) for s in replayer.skipped]}


def _summary(replayer: Replayer, elapsed: float) -> None:
    rate = f", {replayer.replayed / elapsed:,.0f} events/s" if elapsed > 0 and replayer.replayed else ""
    start = f" on top of a snapshot at {replayer.start_seq}" if replayer.start_seq else ""
    print(f"exo replay: {replayer.replayed} events{start}, State at sequence {replayer.state.last_seq}, "
          f"{len(replayer.skipped)} not used, {elapsed:.2f} s{rate}", file=sys.stderr)

