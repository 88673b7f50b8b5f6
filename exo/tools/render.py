"""Text and JSON for what the tools print: event lines, per-event changes, snapshot checks."""

from __future__ import annotations

from typing import Any

import msgspec

from exo.core.state import SkippedEvent
from exo.tools.export_format import format_time_ns
from exo.tools.replay_fold import CheckResult, Step
from exo.tools.state_diff import format_change

_INDENT = " " * 10
_encoder = msgspec.json.Encoder()


def step_text(step: Step) -> str:
    """`     42  2026-12-02T10:55:01.846Z  task.created  task_id=... instance_id=...`, then, indented,
    why it was skipped and what it changed."""
    lines = [f"{step.seq:>8}  {format_time_ns(step.time_ns, digits=3)}  {step.kind:<22} {step.summary}".rstrip()]
    if step.skipped:
        lines.append(f"{_INDENT}! skipped: {step.skipped}")
    if step.changes is not None:
        lines.extend(f"{_INDENT}{format_change(change)}" for change in step.changes)
        if not step.changes and not step.skipped:
            lines.append(f"{_INDENT}(no change to State)")
    return "\n".join(lines)


def step_json(step: Step) -> bytes:
    body: dict[str, Any] = {"type": "event", "seq": step.seq, "time": format_time_ns(step.time_ns),
                            "kind": step.kind, "summary": step.summary}
    if step.skipped:
        body["skipped"] = step.skipped
    if step.changes is not None:
        body["changes"] = [msgspec.to_builtins(change) for change in step.changes]
    return _encoder.encode(body)


def skipped_text(skipped: list[SkippedEvent]) -> list[str]:
    if not skipped:
        return []
    return [f"{len(skipped)} event(s) not used:", *(f"  {s.seq:>8}  {s.reason}" for s in skipped)]


def check_text(check: CheckResult) -> str:
    where = f"snapshot revision {check.revision} at sequence {check.seq}"
    if check.agrees:
        return f"{where}: agrees with the replay"
    replayed = "nothing" if check.op == "removed" else _shown(check.replayed)
    snapshot = "nothing" if check.op == "added" else _shown(check.snapshot)
    return f"{where}: DIFFERS at {check.path}: replay has {replayed}, snapshot has {snapshot}"


def _shown(value: Any) -> str:
    text = _encoder.encode(value).decode()
    return text if len(text) <= 200 else text[:199] + "…"
