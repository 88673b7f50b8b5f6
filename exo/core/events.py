"""The event log's vocabulary. Each event has an explicit, stable wire tag (field "kind").

Renaming a class must never change a tag: old logs must keep decoding. Decoding ignores
unknown fields so older nodes can read logs written by newer ones.
"""

from __future__ import annotations

import msgspec

from exo.core.types import (
    Instance,
    ModelCard,
    NodeInfo,
    RejectionCode,
    RunnerStatus,
    Task,
    TaskStatus,
)


class Event(msgspec.Struct, frozen=True, kw_only=True, tag_field="kind"):
    pass


class NodeRegistered(Event, tag="node.registered", kw_only=True):
    node: NodeInfo


class InstanceCreated(Event, tag="instance.created", kw_only=True):
    command_id: str = ""
    instance: Instance


class InstanceDeleted(Event, tag="instance.deleted", kw_only=True):
    command_id: str = ""
    instance_id: str
    reason: str = ""


class RunnerStatusChanged(Event, tag="runner.status", kw_only=True):
    runner_id: str
    instance_id: str
    node_id: str
    status: RunnerStatus
    error: str = ""


class TaskCreated(Event, tag="task.created", kw_only=True):
    command_id: str = ""
    task: Task


class TaskCancelRequested(Event, tag="task.cancel_requested", kw_only=True):
    command_id: str = ""
    task_id: str


class TaskStarted(Event, tag="task.started", kw_only=True):
    task_id: str


class TaskFinished(Event, tag="task.finished", kw_only=True):
    task_id: str
    status: TaskStatus
    finish_reason: str = ""
    error: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0


class CustomCardAdded(Event, tag="card.added", kw_only=True):
    command_id: str = ""
    card: ModelCard


class CustomCardDeleted(Event, tag="card.deleted", kw_only=True):
    command_id: str = ""
    model_id: str


class CommandRejected(Event, tag="command.rejected", kw_only=True):
    """A command the master could not carry out, with why: the API answers the caller from it."""

    command_id: str
    command_kind: str = ""
    code: RejectionCode = "invalid"
    reason: str = ""


AnyEvent = (
    NodeRegistered
    | InstanceCreated
    | InstanceDeleted
    | RunnerStatusChanged
    | TaskCreated
    | TaskCancelRequested
    | TaskStarted
    | TaskFinished
    | CustomCardAdded
    | CustomCardDeleted
    | CommandRejected
)

_decoder = msgspec.json.Decoder(AnyEvent)
_encoder = msgspec.json.Encoder()


def encode_event(event: Event) -> bytes:
    return _encoder.encode(event)


def decode_event(data: bytes) -> AnyEvent:
    """Raises msgspec.DecodeError / ValidationError for bytes that are not a known event."""
    return _decoder.decode(data)


def event_tag(event: Event) -> str:
    return type(event).__struct_config__.tag  # type: ignore[return-value]


def command_id_of(event: Event) -> str:
    """The command an event answers, or "" for events nobody asked for."""
    return getattr(event, "command_id", "") or ""
