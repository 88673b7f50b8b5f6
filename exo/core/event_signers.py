"""Whose key must have signed an event for the reducer to use it (pure).

Every exo process holds the one shared NATS credential, so the server cannot tell who published an
event (docs/reliability.md, "Who may write what"). Each node signs what it appends with its node
key instead (ed25519 over the subject and the exact payload, in the message's headers: the same
scheme as token chunks, exo/bus/chunk_signing.py), and the reducer asks for the right signer:

- a master's event (its kinds, or any event with a term): the key of the current term's leader,
  when its election was signed by the key it names (`State.leader_key`);
- a node's own event (its registration and heartbeats, its runners' status, its downloads): that
  node's key, once one of its events was signed with it (`NodeInfo.signs_events`).

The events of every request (`task.created`, `command.rejected`, `task.started`, `task.finished`)
are neither signed nor checked: a check costs about 50 us on every node that folds the log, about
0.2 ms per request per node (#50's budget is 0.5 ms for an API node's whole request). Per-node
NATS permissions are to cover those (docs/deploy.md, "Per-node identities").

Checking the crypto is the caller's (exo/bus): the reducer gets `verify`, which says whether the
event's message was signed by a given public key. None: a caller that appended the event itself
(the master folding its own decisions) and checks nothing.

Upgrades: a leader elected without a signature (an older master) and a node none of whose events
was signed yet (an older release) are not asked for one, so a cluster upgrades node by node, and
a master of either release may take over from the other. The price: a forger with the shared
credential can still append an unsigned election, and its term then asks for nothing until the
real master elects itself again (at once). Skipping unsigned elections once one was signed would
close that, and would wedge a mixed cluster whose older master wins the lease (it would lead with
an election nobody folds); per-node NATS permissions close it instead.
"""

from __future__ import annotations

from collections.abc import Callable

from msgspec.structs import replace

from exo.core.draft import Draft
from exo.core.events import (
    AnyEvent,
    CommandRejected,
    DownloadDeleted,
    DownloadFailed,
    DownloadProgressed,
    LeaderElected,
    NodeHeartbeat,
    NodeRegistered,
    RunnerStatusChanged,
    TaskCreated,
    TaskFinished,
    TaskStarted,
)
from exo.core.ids import NodeId
from exo.core.skip import Skip
from exo.core.types import NodeInfo

# Whether the event's message carries a valid signature by this public key (exo/bus/event_log.py).
SignatureCheck = Callable[[str], bool]

PER_REQUEST_KINDS: frozenset[type] = frozenset({TaskCreated, CommandRejected, TaskStarted, TaskFinished})


def is_signed(event: object) -> bool:
    """Whether its writer signs it (and the reducer asks for the signature): all but a request's own."""
    return type(event) not in PER_REQUEST_KINDS


def check_signer(draft: Draft, event: AnyEvent, verify: SignatureCheck, by_master: bool) -> None:
    """Skip `event` unless the key it must be signed with signed it. `by_master`: a master's event.
    The reducer asks this of signed kinds only (`is_signed`), when it has a check."""
    if isinstance(event, LeaderElected):
        return  # checked by the term rules; whether it was signed decides only the key it gives its term
    if by_master:
        if draft.leader_key and not verify(draft.leader_key):
            raise Skip(f"a master's event not signed by the key of term {draft.leader_term}'s leader")
    elif (node := _writer(draft, event)) is not None and node.signs_events and not verify(node.public_key):
        raise Skip(f"a {type(event).__name__} of node {node.node_id} not signed by its key")


def note_signer(draft: Draft, event: AnyEvent, verify: SignatureCheck | None) -> None:
    """After `event` was used: a signed election makes its key the leader's; a node's first event
    signed with its key makes it sign every later one."""
    if isinstance(event, LeaderElected):
        signed = bool(event.public_key) and (verify is None or verify(event.public_key))
        draft.leader_key = event.public_key if signed else ""
    elif verify is not None and (node := _writer(draft, event)) is not None and not node.signs_events \
            and node.public_key and verify(node.public_key):
        draft.own("nodes")[node.node_id] = replace(node, signs_events=True)


def _writer(draft: Draft, event: AnyEvent) -> NodeInfo | None:
    """The node a node's own event speaks for, as State knows it (None: not such an event, or unknown)."""
    node_id: NodeId | None = None
    if isinstance(event, NodeRegistered | NodeHeartbeat):
        node_id = event.node.node_id
    elif isinstance(event, RunnerStatusChanged | DownloadFailed | DownloadDeleted):
        node_id = event.node_id
    elif isinstance(event, DownloadProgressed):
        node_id = event.progress.node_id
    return draft.nodes.get(node_id) if node_id is not None else None

