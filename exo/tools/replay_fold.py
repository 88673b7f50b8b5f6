"""Folding log records into State the way every node does, and noting what an operator needs:
events that could not be used, per-event changes, and whether snapshots agree.

Pure: records come in (from the stream or from an export file), results are plain data.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import msgspec

from exo.bus.chunk_signing import message_check
from exo.bus.tooling.log_reader import LogRecord
from exo.core.apply import apply, skip_event
from exo.core.events import AnyEvent, decode_event
from exo.core.state import SkippedEvent, State
from exo.tools.event_view import EventFilter, describe, kind_of, matches
from exo.tools.state_diff import Change, format_path, state_changes


class Step(msgspec.Struct, frozen=True, kw_only=True):
    """One event as `--list` / `--diff` show it."""

    seq: int
    time_ns: int
    kind: str
    summary: str
    skipped: str = ""  # why it was not used, if it was not
    changes: list[Change] | None = None  # with --diff


class Checkpoint(msgspec.Struct, frozen=True, kw_only=True):
    """A stored snapshot to compare with the replay once it reaches `state.last_seq`."""

    revision: int
    state: State


class CheckResult(msgspec.Struct, frozen=True, kw_only=True):
    seq: int
    revision: int
    agrees: bool
    path: str = ""  # the first path where they differ
    op: str = ""  # at that path the replay has something "added", "removed" or "changed"
    replayed: object = None
    snapshot: object = None


OnStep = Callable[[Step], None]


class Replayer:
    def __init__(
        self,
        state: State | None = None,
        *,
        on_step: OnStep | None = None,
        event_filter: EventFilter = EventFilter(),
        diff: bool = False,
        checkpoints: Iterable[Checkpoint] = (),
    ) -> None:
        self.state = state or State()
        self.start_seq = self.state.last_seq
        self.skipped: list[SkippedEvent] = []
        self.checks: list[CheckResult] = []
        self.replayed = 0
        self._on_step = on_step
        self._filter = event_filter
        self._diff = diff
        self._checkpoints: dict[int, list[Checkpoint]] = {}
        for checkpoint in checkpoints:
            self._checkpoints.setdefault(checkpoint.state.last_seq, []).append(checkpoint)
        self._check(self.state.last_seq)

    @property
    def unreached_checkpoints(self) -> list[Checkpoint]:
        return [c for seq in sorted(self._checkpoints) for c in self._checkpoints[seq]]

    def feed(self, record: LogRecord) -> None:
        if record.seq <= self.state.last_seq:
            return  # already folded in (a snapshot covers it, or a reader sent it twice)
        if record.seq > self.state.last_seq + 1:
            first, last = self.state.last_seq + 1, record.seq - 1
            missing = f"sequence {first}" if first == last else f"sequences {first}-{last}"
            self.skipped.append(SkippedEvent(seq=first, reason=f"{missing} missing from the log"))
        before = self.state
        self.state, event, reason = _fold(before, record)
        self.replayed += 1
        if reason:
            self.skipped.append(SkippedEvent(seq=record.seq, reason=reason))
        if self._on_step is not None:
            self._show(record, before, event, reason)
        if self._checkpoints:
            self._check(record.seq)

    def _show(self, record: LogRecord, before: State, event: AnyEvent | None, reason: str) -> None:
        if self._on_step is None:
            return
        kind = kind_of(record.subject, event)
        if not matches(self._filter, kind, event, before):
            return
        changes = state_changes(before, self.state) if self._diff else None
        summary = describe(event) if event is not None else ""
        self._on_step(Step(seq=record.seq, time_ns=record.time_ns, kind=kind, summary=summary,
                           skipped=reason, changes=changes))

    def _check(self, seq: int) -> None:
        for checkpoint in self._checkpoints.pop(seq, []):
            self.checks.append(compare(self.state, checkpoint))


def _fold(state: State, record: LogRecord) -> tuple[State, AnyEvent | None, str]:
    """(new State, the event or None, why it was not used or "")."""
    try:
        event = decode_event(record.data)
    except (msgspec.DecodeError, msgspec.ValidationError) as error:
        reason = f"undecodable event on {record.subject}: {error}"
        return skip_event(state, record.seq, reason), None, reason
    new_state = apply(state, event, record.seq, message_check(record.subject, record.data, record.headers))
    if new_state.skipped_events is not state.skipped_events:  # the reducer recorded a skip
        return new_state, event, new_state.skipped_events[-1].reason
    return new_state, event, ""


def compare(replayed: State, checkpoint: Checkpoint) -> CheckResult:
    seq, revision = checkpoint.state.last_seq, checkpoint.revision
    if replayed == checkpoint.state:
        return CheckResult(seq=seq, revision=revision, agrees=True)
    changes = state_changes(checkpoint.state, replayed)
    if not changes:  # only last_seq differs (cannot happen at a checkpoint, but say so if it does)
        return CheckResult(seq=seq, revision=revision, agrees=False, path="last_seq", op="changed",
                           replayed=replayed.last_seq, snapshot=checkpoint.state.last_seq)
    first = changes[0]
    return CheckResult(seq=seq, revision=revision, agrees=False, path=format_path(first.path), op=first.op,
                       replayed=first.after, snapshot=first.before)
