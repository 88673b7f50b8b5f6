"""What changed between two States, as a list of (added | removed | changed, path, values).

States share structure: the reducer copies a dict only to change it and keeps every untouched
value as the same object, so comparing by identity first makes a per-event diff cheap even when
State holds thousands of tasks.
"""

from __future__ import annotations

import re
from typing import Any, Literal

import msgspec

from exo.core.state import State

Path = tuple[str | int, ...]
_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_MAX_SHOWN_CHARS = 160


class Change(msgspec.Struct, frozen=True, kw_only=True):
    op: Literal["added", "removed", "changed"]
    path: Path
    before: Any = None
    after: Any = None


def state_changes(before: State, after: State) -> list[Change]:
    """Every difference outside `last_seq`, in State's field order; within a mapping, removed and
    changed keys in their old order, then added ones."""
    changes: list[Change] = []
    for field in State.__struct_fields__:
        if field == "last_seq":
            continue
        old, new = getattr(before, field), getattr(after, field)
        if old is new:
            continue
        if isinstance(old, dict) and isinstance(new, dict):
            _dict_of_structs_changes((field,), old, new, changes)
        else:
            _value_changes((field,), msgspec.to_builtins(old), msgspec.to_builtins(new), changes)
    return changes


def _dict_of_structs_changes(path: Path, old: dict[Any, Any], new: dict[Any, Any], changes: list[Change]) -> None:
    for key, value in old.items():
        if key not in new:
            changes.append(Change(op="removed", path=(*path, key), before=msgspec.to_builtins(value)))
        elif new[key] is not value:
            _value_changes((*path, key), msgspec.to_builtins(value), msgspec.to_builtins(new[key]), changes)
    changes.extend(Change(op="added", path=(*path, key), after=msgspec.to_builtins(value))
                   for key, value in new.items() if key not in old)


def _value_changes(path: Path, old: Any, new: Any, changes: list[Change]) -> None:
    if old == new:
        return
    if isinstance(old, dict) and isinstance(new, dict):
        for key, value in old.items():
            if key not in new:
                changes.append(Change(op="removed", path=(*path, key), before=value))
            else:
                _value_changes((*path, key), value, new[key], changes)
        changes.extend(Change(op="added", path=(*path, key), after=value) for key, value in new.items() if key not in old)
    elif isinstance(old, list) and isinstance(new, list):
        _list_changes(path, old, new, changes)
    else:
        changes.append(Change(op="changed", path=path, before=old, after=new))


def _list_changes(path: Path, old: list[Any], new: list[Any], changes: list[Change]) -> None:
    """Bounded logs (like `skipped_events`) drop from the front and append at the back: show
    that as such, not as every element changed."""
    if not old:
        changes.extend(Change(op="added", path=(*path, i), after=item) for i, item in enumerate(new))
        return
    for dropped in range(len(old)):
        kept = old[dropped:]
        if new[: len(kept)] == kept:
            changes.extend(Change(op="removed", path=(*path, i), before=old[i]) for i in range(dropped))
            changes.extend(Change(op="added", path=(*path, i), after=new[i]) for i in range(len(kept), len(new)))
            return
    if len(old) == len(new):
        for index, (a, b) in enumerate(zip(old, new, strict=True)):
            _value_changes((*path, index), a, b, changes)
        return
    changes.append(Change(op="changed", path=path, before=old, after=new))


def format_path(path: Path) -> str:
    """`tasks["4f2c"].status`, `skipped_events[3]`, `custom_model_cards["org/m"]`."""
    text = ""
    for part in path:
        if isinstance(part, int):
            text += f"[{part}]"
        elif _IDENTIFIER.match(part):
            text += f".{part}" if text else part
        else:
            text += f"[{msgspec.json.encode(part).decode()}]"
    return text


def format_change(change: Change) -> str:
    path = format_path(change.path)
    if change.op == "added":
        return f"+ {path} = {_shown(change.after)}"
    if change.op == "removed":
        return f"- {path}"
    return f"~ {path}: {_shown(change.before)} -> {_shown(change.after)}"


def _shown(value: Any) -> str:
    text = msgspec.json.encode(value).decode()
    return text if len(text) <= _MAX_SHOWN_CHARS else text[: _MAX_SHOWN_CHARS - 1] + "…"
