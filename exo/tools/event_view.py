"""How the tools show and select events: one readable line per event, and `--filter KEY=VALUE`.

Both work from the event's fields generically (any `node_id`, `instance_id`, `command_id` or
`task_id` at any depth), so a new event kind is shown and filtered without touching this file.
"""

from __future__ import annotations

import fnmatch
from typing import Any

import msgspec

from exo.bus.subjects import event_subject
from exo.core.events import AnyEvent
from exo.core.ids import CommandId
from exo.core.state import State

FILTER_KEYS = ("kind", "node", "instance", "command")
_EVENT_SUBJECT_PREFIX = event_subject("")
_MAX_VALUE_CHARS = 60


class EventFilter(msgspec.Struct, frozen=True, kw_only=True):
    """Each given key must match (AND); several values of one key are alternatives (OR).
    `kind` takes shell patterns (`task.*`); `command` also matches a task id, which is the
    id of the command that asked for the task."""

    kind: tuple[str, ...] = ()
    node: tuple[str, ...] = ()
    instance: tuple[str, ...] = ()
    command: tuple[str, ...] = ()

    @property
    def is_empty(self) -> bool:
        return not (self.kind or self.node or self.instance or self.command)


def parse_filters(specs: list[str]) -> EventFilter:
    """`["kind=task.*", "node=n1", "node=n2"]` -> EventFilter; ValueError names a bad spec."""
    values: dict[str, list[str]] = {key: [] for key in FILTER_KEYS}
    for spec in specs:
        key, sep, value = spec.partition("=")
        if not sep or key not in values or not value:
            raise ValueError(f"bad filter {spec!r}: use KEY=VALUE with KEY one of {', '.join(FILTER_KEYS)}")
        values[key].append(value)
    return EventFilter(**{key: tuple(v) for key, v in values.items()})


def kind_of(subject: str, event: AnyEvent | None) -> str:
    """The event's tag; for an undecodable payload, the tag its subject claims."""
    if event is not None:
        return type(event).__struct_config__.tag  # type: ignore[return-value]
    return subject.removeprefix(_EVENT_SUBJECT_PREFIX)


def event_refs(event: AnyEvent, state: State | None) -> dict[str, set[str]]:
    """The nodes, instances and commands an event concerns. With the State from before the
    event, also those it implies: a task's instance, an instance's nodes."""
    found: dict[str, set[str]] = {"node_id": set(), "instance_id": set(), "command_id": set(), "task_id": set()}
    _collect_ids(msgspec.to_builtins(event), found)
    commands = (found["command_id"] | found["task_id"]) - {""}
    instances = set(found["instance_id"])
    nodes = set(found["node_id"])
    if state is not None:
        instances |= {task.instance_id for t in commands if (task := state.tasks.get(CommandId(t))) is not None}
        for instance in state.instances.values():
            nodes |= {shard.node_id for shard in instance.shards} if instance.instance_id in instances else set()
    return {"node": nodes - {""}, "instance": instances - {""}, "command": commands}


def _collect_ids(value: Any, found: dict[str, set[str]]) -> None:
    if isinstance(value, dict):
        for key, item in value.items():
            if key in found and isinstance(item, str):
                found[key].add(item)
            else:
                _collect_ids(item, found)
    elif isinstance(value, list):
        for item in value:
            _collect_ids(item, found)


def matches(event_filter: EventFilter, kind: str, event: AnyEvent | None, state: State | None) -> bool:
    if event_filter.is_empty:
        return True
    if event_filter.kind and not any(fnmatch.fnmatchcase(kind, p) for p in event_filter.kind):
        return False
    if not (event_filter.node or event_filter.instance or event_filter.command):
        return True
    if event is None:
        return False  # an undecodable payload names nothing
    refs = event_refs(event, state)
    return all(
        not wanted or refs[key] & set(wanted)
        for key, wanted in (("node", event_filter.node), ("instance", event_filter.instance),
                            ("command", event_filter.command))
    )


def key_fields(event: AnyEvent) -> list[tuple[str, str]]:
    """The fields worth a glance: top-level values that are set (not 0 / empty) or required (a
    desire.scaled's `to_replicas=0`), and the ids and statuses of nested ones."""
    required = {f.encode_name for f in msgspec.structs.fields(event) if f.required}
    fields: list[tuple[str, str]] = []
    for name, value in msgspec.to_builtins(event).items():
        if name == "kind" or not (value or name in required and isinstance(value, int)):
            continue
        if isinstance(value, (dict, list)):
            fields.extend(_nested_ids(value))
        else:
            fields.append((name, _short(str(value))))
    return fields


def _nested_ids(value: Any) -> list[tuple[str, str]]:
    collected: dict[str, list[str]] = {}

    def walk(item: Any) -> None:
        if isinstance(item, dict):
            for key, inner in item.items():
                if isinstance(inner, (dict, list)):
                    walk(inner)
                elif (key.endswith("_id") or key == "status") and inner not in ("", None):
                    seen = collected.setdefault(key, [])
                    if str(inner) not in seen:
                        seen.append(str(inner))
        elif isinstance(item, list):
            for inner in item:
                walk(inner)

    walk(value)
    return [(key, _short(",".join(values))) for key, values in collected.items()]


def _short(text: str) -> str:
    text = text.replace("\n", " ")
    return text if len(text) <= _MAX_VALUE_CHARS else text[: _MAX_VALUE_CHARS - 1] + "…"


def describe(event: AnyEvent) -> str:
    return " ".join(f"{name}={value}" for name, value in key_fields(event))
