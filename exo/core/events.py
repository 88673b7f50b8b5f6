"""The event log's vocabulary. Each event has an explicit, stable wire tag (field "kind").

Renaming a class must never change a tag: old logs must keep decoding. Decoding ignores
unknown fields so older nodes can read logs written by newer ones.
"""

from __future__ import annotations

import msgspec

from exo.core.adapters import Adapter
from exo.core.ids import CommandId, InstanceId, ModelId, NodeId, RunnerId, TaskId
from exo.core.join_tokens import JoinToken
from exo.core.keys import ApiKey
from exo.core.types import (
    ClusterLayout,
    Desire,
    DownloadProgress,
    Instance,
    ModelCard,
    NodeInfo,
    RejectionCode,
    RunnerStatus,
    Task,
    TaskStatus,
)


class Event(msgspec.Struct, frozen=True, kw_only=True, tag_field="kind"):
    # The master's term for events a master appends (0 for workers' events): the stream sequence
    # of its leader.elected. The reducer ignores master events of any other term: a deposed master
    # that wakes up late, or a stray publisher, cannot change State. (Logs from before
    # `lease_revision` used the lease's revision as the term, and "older than" as the rule.)
    term: int = 0


class LeaderElected(Event, frozen=True, tag="leader.elected", kw_only=True):
    """The latest one in the log is the leader. Its term is its own sequence: nothing a publisher
    writes into an event can raise it, so a forged election lasts only until the lease holder
    elects itself again (it does at once: exo/master/service.py)."""

    node_id: NodeId
    lease_revision: int = 0  # the lease's KV revision the master won; 0: an election of the old scheme
    # The master's node key (public half): a starting node checks its snapshots' signatures with it
    # when the node never registered one (a master-only node). "": an older master, or none.
    public_key: str = ""


class NodeRegistered(Event, frozen=True, tag="node.registered", kw_only=True):
    node: NodeInfo


class NodeHeartbeat(Event, frozen=True, tag="node.heartbeat", kw_only=True):
    """A node is alive and this is what it has now (memory changes as models load)."""

    node: NodeInfo


class ClusterLayoutChanged(Event, frozen=True, tag="cluster.layout", kw_only=True):
    """A discovered cluster's servers, meta leader or stream placement changed; written by the
    node whose server leads the meta group (exo/node.py's layout recorder, called from
    exo/bus/server/cluster_node.py), only on change."""

    layout: ClusterLayout


class NodeTimedOut(Event, frozen=True, tag="node.timed_out", kw_only=True):
    """The master has not heard from the node for its timeout: it is out of State until it speaks again."""

    node_id: NodeId
    reason: str = ""


class NodeRemoved(Event, frozen=True, tag="node.removed", kw_only=True):
    """An admin removed the node (`exo node remove`): it leaves State for good. Its instances ended
    just before (their tasks moved), and the reducer ignores what it says of itself from here on
    (exo/core/revocation.py); State keeps its key as revoked."""

    command_id: CommandId = CommandId("")
    node_id: NodeId
    public_key: str = ""  # its key in State when removed ("": it had none)
    reason: str = ""
    removed_by: str = ""  # who asked: the API key (or "an admin") and the API node that took the request


class JoinTokenCreated(Event, frozen=True, tag="join_token.created", kw_only=True):
    """An admin made a join token (`exo token create`): State keeps its digest, expiry and uses."""

    command_id: CommandId = CommandId("")
    token: JoinToken


class JoinTokenRedeemed(Event, frozen=True, tag="join_token.redeemed", kw_only=True):
    """A new node used a join token (POST /cluster/join): one use fewer."""

    command_id: CommandId = CommandId("")
    token_id: str
    secret_sha256: str  # what was presented, checked again by the reducer
    node_name: str = ""  # the name the new node gave, for the log
    at: float = 0.0  # the API's wall clock when it was used: the expiry is checked against it


class NodeSuspected(Event, frozen=True, tag="node.suspect", kw_only=True):
    """The master's mark on a node silent for its suspect time (`suspect`), or the mark's end once
    the node is heard again: appended only when the mark changes (exo/master/supervise.py)."""

    node_id: NodeId
    suspect: bool = True
    reason: str = ""
    at: float = 0.0  # the master's wall clock: State keeps it as the node's suspect_since


class Eviction(msgspec.Struct, frozen=True, kw_only=True):
    """A desire unloaded to make room for an instance (exo/master/eviction.py): its model and instances."""

    desire_id: str
    model_id: ModelId
    instance_ids: list[InstanceId]


class InstanceCreated(Event, frozen=True, tag="instance.created", kw_only=True):
    command_id: CommandId = CommandId("")
    instance: Instance
    evicted: list[Eviction] = []  # unloaded to make room for it, in the same decision (ended just before it)


class InstanceDeleted(Event, frozen=True, tag="instance.deleted", kw_only=True):
    command_id: CommandId = CommandId("")
    instance_id: InstanceId
    reason: str = ""


class DesireSet(Event, frozen=True, tag="desire.set", kw_only=True):
    """A desire made or changed (its replicas, why it waits, its back-off): the whole record."""

    command_id: CommandId = CommandId("")
    desire: Desire


class DesireEnded(Event, frozen=True, tag="desire.ended", kw_only=True):
    command_id: CommandId = CommandId("")
    desire_id: str
    reason: str = ""


class DesireScaled(Event, frozen=True, tag="desire.scaled", kw_only=True):
    """The master changed a desire's replicas to follow its load (exo/master/autoscale.py), with why.
    A step down names no instance: the InstanceDeleted after it does."""

    desire_id: str
    from_replicas: int
    to_replicas: int
    reason: str = ""
    at: float = 0.0  # wall clock: the next step waits a window from here


class TaskMigrated(Event, frozen=True, tag="task.migrated", kw_only=True):
    """The task's instance died: it continues on `to_instance` ("": once one of its model is ready)."""

    task_id: TaskId
    to_instance: InstanceId = InstanceId("")
    reason: str = ""
    at: float = 0.0


class RunnerStatusChanged(Event, frozen=True, tag="runner.status", kw_only=True):
    runner_id: RunnerId
    instance_id: InstanceId
    node_id: NodeId
    status: RunnerStatus
    error: str = ""
    failures: int = 0  # consecutive failures of this runner (restarts since it was last ready)
    at: float = 0.0  # the worker's clock (wall) when it changed: a keep_alive counts from readiness
    warm_up_s: float = 0.0  # "ready": what the runner's warm-up took (0: not said)
    prefill_address: str = ""  # "ready", a prefill instance's runner: where it serves prompts' KV caches


class TaskCreated(Event, frozen=True, tag="task.created", kw_only=True):
    command_id: CommandId = CommandId("")
    task: Task


class TaskCancelRequested(Event, frozen=True, tag="task.cancel_requested", kw_only=True):
    command_id: CommandId = CommandId("")
    task_id: TaskId
    reason: str = ""  # why, when its client did not ask (its key was deleted): its stream's last error says it


class TaskStarted(Event, frozen=True, tag="task.started", kw_only=True):
    task_id: TaskId
    attempt: int = 0  # the run that started (len(task.migrations)); an older run's is skipped


class TaskFinished(Event, frozen=True, tag="task.finished", kw_only=True):
    task_id: TaskId
    status: TaskStatus
    finish_reason: str = ""
    error: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens reused from the runner's prompt cache
    audio_seconds: float = 0.0  # a text-to-speech task's: the speech its runner generated
    attempt: int = 0  # the run that ended (len(task.migrations)); an older run's end is skipped (from workers)
    generation_s: float = 0.0  # its runner's time from the generation's start to its end, as its worker saw it; 0: unknown
    at: float = 0.0  # the wall clock of its end, as its worker saw it (0: unknown): a desire's idle time counts from it


class CustomCardAdded(Event, frozen=True, tag="card.added", kw_only=True):
    command_id: CommandId = CommandId("")
    card: ModelCard


class CustomCardDeleted(Event, frozen=True, tag="card.deleted", kw_only=True):
    command_id: CommandId = CommandId("")
    model_id: ModelId


class AdapterAdded(Event, frozen=True, tag="adapter.added", kw_only=True):
    command_id: CommandId = CommandId("")
    adapter: Adapter


class AdapterDeleted(Event, frozen=True, tag="adapter.deleted", kw_only=True):
    command_id: CommandId = CommandId("")
    name: str


class AdapterDeleting(Event, frozen=True, tag="adapter.deleting", kw_only=True):
    """DELETE /adapters of one that requests use: marked, refused to new requests, deleted (an
    adapter.deleted with no command) once the last of them ends."""

    command_id: CommandId = CommandId("")
    name: str


class KeySet(Event, frozen=True, tag="key.set", kw_only=True):
    command_id: CommandId = CommandId("")
    key: ApiKey


class KeyDeleted(Event, frozen=True, tag="key.deleted", kw_only=True):
    command_id: CommandId = CommandId("")
    key_id: str


class CommandRejected(Event, frozen=True, tag="command.rejected", kw_only=True):
    """A command the master could not carry out, with why: the API answers the caller from it."""

    command_id: CommandId
    command_kind: str = ""
    code: RejectionCode = "invalid"
    reason: str = ""
    retry_after_s: float = 0.0  # rate_limited: when the key may try again


class DownloadProgressed(Event, frozen=True, tag="download.progress", kw_only=True):
    """A node's download of a model started, moved on (at most about once a second), completed
    or was cancelled: the whole record, so the latest one is all a reader needs."""

    progress: DownloadProgress


class DownloadFailed(Event, frozen=True, tag="download.failed", kw_only=True):
    node_id: NodeId
    model_id: ModelId
    # A DownloadErrorCode; a plain string so that older nodes still read codes added later.
    code: str = "unknown"
    reason: str = ""
    at: float = 0.0


class DownloadDeleted(Event, frozen=True, tag="download.deleted", kw_only=True):
    """The node removed the model's files (never from a read-only directory) and its status."""

    node_id: NodeId
    model_id: ModelId


class GroupsSet(Event, frozen=True, tag="groups.set", kw_only=True):
    """The master group map (exo/core/groups.py): group name -> the model-id globs it serves."""

    groups: dict[str, list[str]]


AnyEvent = (
    LeaderElected
    | NodeRegistered
    | NodeHeartbeat
    | NodeTimedOut
    | NodeRemoved
    | JoinTokenCreated
    | JoinTokenRedeemed
    | NodeSuspected
    | InstanceCreated
    | InstanceDeleted
    | RunnerStatusChanged
    | TaskCreated
    | TaskCancelRequested
    | TaskStarted
    | TaskFinished
    | CustomCardAdded
    | CustomCardDeleted
    | AdapterAdded
    | AdapterDeleted
    | AdapterDeleting
    | KeySet
    | KeyDeleted
    | CommandRejected
    | DownloadProgressed
    | DownloadFailed
    | DownloadDeleted
    | ClusterLayoutChanged
    | DesireSet
    | DesireEnded
    | DesireScaled
    | TaskMigrated
    | GroupsSet
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
