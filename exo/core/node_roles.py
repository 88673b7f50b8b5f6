"""What one node may publish and subscribe to on NATS, from its id and its roles (pure).

Per-node identities (docs/deploy.md, "Per-node identities"): each node gets a NATS user of its own,
with the permissions this module derives; the subjects' spelling comes from a `SubjectTable`
(exo/bus/server/node_subjects.py: only exo/bus builds subject strings) and nats-server's config
is rendered by exo/bus/server/node_keys.py. Not wired into node start-up yet.

Roles, and what each publishes today (every publish site in exo/bus, by its caller):

- every node: `cluster.layout` (the node whose server leads the meta group); JetStream reads.
  Subscribes to its replies (`_INBOX.>`).
- worker (and its runners): the worker kinds `node.registered`, `node.heartbeat`, `runner.status`,
  `task.started`, `task.finished`, `download.*` (task events into a master group's log too); its
  pulse `exo.liveness.<node>`; cache reports `exo.cache.<instance>`; token chunks
  `exo.tokens.<command>`; model-share requests to peers. Answers `exo.models.<node>.*` and
  `exo.downloads.<node>.*`.
- master (candidate): the master kinds (exo/core/apply.py's MASTER_KINDS), `leader.elected`,
  `task.finished` of deleted instances; the snapshot (`$KV.exo-state.>`) and the lease
  (`$KV.exo-leader.>`); pulls and acks its commands; creates and updates streams (provisioning,
  which every node does today: see docs/deploy.md for the change). Subscribes to pulses and
  cache reports.
- api: commands `exo.commands.<tag>`; images and adapters (object stores, which purge an
  object's old chunks); download-control, model-share (tokenizers) and reader requests.
  Subscribes to token chunks and answers `exo.readers.>`.
- operator: nothing; reads everything but request subjects (exo/bus/server/permissions.py).

A JetStream append is a plain publish on the stream's subject with a reply inbox, to which the
server sends the PubAck: it needs publish on that subject and subscribe on the inbox, and no
`$JS.API` grant. The `$JS.API.>` subjects are calls to the server: reads (info, message get, direct
get, ordered consumers and their flow control) are granted to every role; stream creation to a
master only; delete, purge and update of the log never to a worker or an API node. Nobody but the
server may subscribe to `$JS.API.>` (whoever does answers in its place). A node answers requests
(model shares, download control, readers) through `allow_responses`, never with a publish grant
on `_INBOX.>`.

What the server can check depends on whether a subject names its writer. Pulses, model shares
and download controls do (`exo.liveness.<node>`, ...): a worker can publish only its own pulse
today. Event subjects name only the kind (`exo.events.<kind>`), so today the server can refuse a
worker a master kind, but not a worker kind written as another node; token chunks
(`exo.tokens.<command>`), cache reports (`exo.cache.<instance>`) and inboxes (`_INBOX.<nuid>`)
name no node either. The subject change that lets the server check the writer:

    exo.events.<node>.<kind>  (exo.group.<g>.events.<node>.<kind>)   EXO_EVENTS still takes exo.events.>
    exo.tokens.<command>.<node>     the API node subscribes exo.tokens.<command>.* and keeps the
                                    chunks of the node that runs the task's current run
    exo.cache.<node>.<instance>     the master keeps reports of instances whose rank 0 is on <node>
    _INBOX.<node>.>                 nats-py's inbox_prefix: replies to a node reach only it

With it, the server refuses a node writing as another, and the reducer checks what permissions
cannot (a worker's event names its own node; a master's comes from the lease holder of its term).
A `SubjectTable` spells either scheme: a node's grant is its own subjects where they name it,
every node's where they do not.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from enum import StrEnum
from typing import Protocol

import msgspec

from exo.core.apply import MASTER_KINDS
from exo.core.events import (
    ClusterLayoutChanged,
    DownloadDeleted,
    DownloadFailed,
    DownloadProgressed,
    Event,
    LeaderElected,
    NodeHeartbeat,
    NodeRegistered,
    RunnerStatusChanged,
    TaskFinished,
    TaskStarted,
)
from exo.core.ids import NodeId


class Role(StrEnum):
    WORKER = "worker"
    MASTER = "master"  # a master candidate: it may win the lease, then decide and snapshot
    API = "api"
    OPERATOR = "operator"  # read-only tools: a role of its own, never a node's


def _tags(kinds: Iterable[type[Event]]) -> frozenset[str]:
    return frozenset(str(kind.__struct_config__.tag) for kind in kinds)


WORKER_KINDS = _tags({NodeRegistered, NodeHeartbeat, RunnerStatusChanged, TaskStarted, TaskFinished,
                      DownloadProgressed, DownloadFailed, DownloadDeleted})
GROUP_WORKER_KINDS = _tags({TaskStarted, TaskFinished})  # a task's events go to the log that holds it
MEMBER_KINDS = _tags({ClusterLayoutChanged})  # whichever node's server leads the meta group
# A master also ends the tasks of instances it deleted (with its term).
MASTER_WRITES = _tags({*MASTER_KINDS, LeaderElected, TaskFinished})


def kinds_written_by(roles: Iterable[Role]) -> frozenset[str]:
    """The event kinds (tags) a node of these roles appends."""
    written = set(MEMBER_KINDS)
    for role in roles:
        written |= {Role.WORKER: WORKER_KINDS, Role.MASTER: MASTER_WRITES}.get(role, frozenset())
    return frozenset(written)


class SubjectRules(msgspec.Struct, frozen=True, kw_only=True):
    allow: tuple[str, ...] = ()
    deny: tuple[str, ...] = ()  # wins over allow


class NatsPermissions(msgspec.Struct, frozen=True, kw_only=True):
    """One NATS user's permissions, as nats-server's `permissions` block says them."""

    publish: SubjectRules
    subscribe: SubjectRules
    allow_responses: bool = False  # may answer (once) each request it received


class SubjectTable(Protocol):
    """The subjects permissions are made of. Given a `writer`, a method returns what that node may
    publish: its own subjects where they name their writer, every node's where they do not. Given
    None, every node's (a reader's grant)."""

    master_consumer: str

    def events(self, kind: str, writer: NodeId | None, groups: bool) -> list[str]:
        """`kind`'s subjects in the shared log, and with `groups` in every master group's log too."""
        ...

    def commands(self) -> list[str]: ...
    def commands_streams(self, groups: Sequence[str]) -> list[str]: ...
    def pulse(self, node: NodeId | None) -> str: ...
    def cache_reports(self, writer: NodeId | None) -> str: ...
    def tokens(self, writer: NodeId | None) -> str: ...
    def model_shares(self, node: NodeId | None) -> str: ...
    def download_controls(self, node: NodeId | None) -> str: ...
    def readers(self) -> str: ...
    def inbox(self, node: NodeId) -> str: ...
    def snapshots(self) -> str: ...
    def leases(self) -> str: ...
    def blobs(self) -> list[str]:
        """Every object store's subjects (chunks and metadata)."""
        ...

    def blob_streams(self) -> list[str]: ...
    def probe_stream(self, node: NodeId) -> str | None:
        """The disk-fit probe's stream (created and deleted while provisioning), or None where its
        name is not the node's own (today's is random: no grant can name it)."""
        ...

    def jetstream_api(self, *tokens: str) -> str: ...
    def jetstream_ack(self, *tokens: str) -> str: ...
    def flow_control(self) -> str: ...


ALL = ">"  # a wildcard token: every subject below
ANY = "*"  # a wildcard token: one, any name
_ONE_TOKEN = re.compile(r"[A-Za-z0-9_-]+")


def _reads(t: SubjectTable) -> list[str]:
    """The JetStream calls that read: what an operator's `nats` and exo's catch-up, followers,
    KV and object-store reads make (ordered consumers, with their flow-control replies)."""
    api = t.jetstream_api
    return [api("INFO"), api("STREAM.INFO", ALL), api("STREAM.LIST"), api("STREAM.NAMES"),
            api("STREAM.MSG.GET", ALL), api("DIRECT.GET", ALL),
            api("CONSUMER.INFO", ALL), api("CONSUMER.LIST", ALL), api("CONSUMER.NAMES", ALL),
            api("CONSUMER.CREATE", ALL), api("CONSUMER.DELETE", ALL), api("CONSUMER.MSG.NEXT", ALL),
            t.flow_control()]


def _master_consumer_denials(t: SubjectTable, groups: Sequence[str]) -> list[str]:
    """Whoever is no master may neither take over, delete, pull from nor settle for a master's
    command consumer (any log's): it would decide or drop commands. The legacy create names the
    consumer in the body, so it is denied per commands stream."""
    api, master = t.jetstream_api, t.master_consumer
    return [api("CONSUMER.CREATE", ANY, master), api("CONSUMER.CREATE", ANY, master, ALL),
            *(api("CONSUMER.CREATE", stream) for stream in t.commands_streams(groups)),
            api("CONSUMER.DELETE", ANY, master), api("CONSUMER.MSG.NEXT", ANY, master),
            t.jetstream_ack(ANY, master, ALL)]


def operator_permissions(t: SubjectTable, groups: Sequence[str] = ()) -> NatsPermissions:
    """Reads everything, writes nothing (exo/bus/server/permissions.py's operator, derived)."""
    return NatsPermissions(
        publish=SubjectRules(allow=(*_reads(t), t.jetstream_ack(ALL)), deny=tuple(_master_consumer_denials(t, groups))),
        # Subscribing to a request subject would let one answer it in the node's or the server's place.
        subscribe=SubjectRules(allow=(ALL,), deny=(t.model_shares(None), t.download_controls(None), t.readers(),
                                                   t.jetstream_api(ALL))),
    )


def _event_grants(t: SubjectTable, node: NodeId, roles: frozenset[Role]) -> list[str]:
    grants: list[str] = []
    for kind in sorted(kinds_written_by(roles)):
        in_groups = (Role.MASTER in roles and kind in MASTER_WRITES) or (Role.WORKER in roles and kind in GROUP_WORKER_KINDS)
        grants += t.events(kind, node, groups=in_groups)
    return grants


def _worker(t: SubjectTable, node: NodeId) -> tuple[list[str], list[str]]:
    """(publish, subscribe) of a worker and its runners, besides events."""
    return ([t.pulse(node), t.cache_reports(node), t.tokens(node), t.model_shares(None)],
            [t.model_shares(node), t.download_controls(node)])


def _master(t: SubjectTable, node: NodeId) -> tuple[list[str], list[str]]:
    api = t.jetstream_api
    probe = t.probe_stream(node)
    provisioning = [api("STREAM.CREATE", ANY), api("STREAM.UPDATE", ANY), *([api("STREAM.DELETE", probe)] if probe else [])]
    commands = [api("CONSUMER.MSG.NEXT", ANY, t.master_consumer), t.jetstream_ack(ANY, t.master_consumer, ALL)]
    return [t.snapshots(), t.leases(), *commands, *provisioning], [t.pulse(None), t.cache_reports(None)]


def _api(t: SubjectTable) -> tuple[list[str], list[str]]:
    # nats-py's object store purges an object's old chunks when it is replaced or deleted.
    blobs = [*t.blobs(), *(t.jetstream_api("STREAM.PURGE", stream) for stream in t.blob_streams())]
    requests = [t.download_controls(None), t.model_shares(None), t.readers()]
    return [*t.commands(), *blobs, *requests], [t.tokens(None), t.readers()]


def node_permissions(node: NodeId, roles: Iterable[Role], t: SubjectTable, groups: Sequence[str] = ()) -> NatsPermissions:
    """The permissions of node `node` with `roles` (a union: a default node is worker, master and
    api). `groups`: the master groups' names, for the denials that must name their streams."""
    chosen = frozenset(roles)
    if not _ONE_TOKEN.fullmatch(node):  # a dot or a wildcard in it would widen every grant that names it
        raise ValueError(f"node id {node!r} cannot name NATS subjects: only letters, digits, _ and - may")
    if not chosen or Role.OPERATOR in chosen:
        raise ValueError(f"a node has one or more of worker, master and api, not {sorted(chosen) or 'none'}")
    publish, subscribe = [*_reads(t), *_event_grants(t, node, chosen)], [t.inbox(node)]
    for role, (more_publish, more_subscribe) in ((Role.WORKER, _worker(t, node)), (Role.MASTER, _master(t, node)),
                                                  (Role.API, _api(t))):
        if role in chosen:
            publish += more_publish
            subscribe += more_subscribe
    deny = () if Role.MASTER in chosen else tuple(_master_consumer_denials(t, groups))
    return NatsPermissions(publish=SubjectRules(allow=_unique(publish), deny=deny),
                           subscribe=SubjectRules(allow=_unique(subscribe)),
                           allow_responses=bool(chosen & {Role.WORKER, Role.API}))


def _unique(subjects: Iterable[str]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(subjects))
