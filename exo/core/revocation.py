"""Removed nodes (`exo node remove`, NodeRemoved): the reducer's handler, and what a removed node
may no longer do. Pure; exo/core/apply.py dispatches here.

A removed node leaves State for good: the reducer ignores every event that speaks for it (its
registration and heartbeats, its runners' status, its downloads), so it cannot come back under
the same id. Its tasks' events need no check of their own: its instances ended when it was
removed, so its runners' task.started / task.finished name a run the task has moved on from, and
are skipped for that. State keeps each removed node's key (bounded, MAX_REVOKED_NODES): the
chunks it signed for runs before its removal still verify when a resume reads them
(exo/core/chunk_signers.py); none of a later run can name it. What the shared NATS credential
still allows (registering under a new node id) is in docs/deploy.md, "Removing a node".
"""

from __future__ import annotations

from exo.core.draft import Draft
from exo.core.events import (
    AnyEvent,
    DownloadDeleted,
    DownloadFailed,
    DownloadProgressed,
    NodeHeartbeat,
    NodeRegistered,
    NodeRemoved,
    RunnerStatusChanged,
)
from exo.core.ids import NodeId
from exo.core.node_names import SHORT_ID, node_label
from exo.core.skip import Skip
from exo.core.state import MAX_REVOKED_NODES, RevokedNode, State


def speaks_for(event: AnyEvent) -> NodeId | None:
    """The node a worker's event says it comes from (None: a kind that names none)."""
    match event:
        case NodeRegistered() | NodeHeartbeat():
            return event.node.node_id
        case RunnerStatusChanged() | DownloadFailed() | DownloadDeleted():
            return event.node_id
        case DownloadProgressed():
            return event.progress.node_id
    return None


def refuse_if_revoked(draft: Draft, event: AnyEvent) -> None:
    """Skip an event of a removed node: it must not come back, nor change what State says of it;
    nor may its key come back under another node id (its data dir kept, node_id deleted)."""
    node_id = speaks_for(event)
    if node_id is not None and (revoked := draft.revoked_nodes.get(node_id)) is not None:
        raise Skip(f"node {node_id} was removed (event {revoked.seq}): what it says of itself is ignored")
    if isinstance(event, (NodeRegistered, NodeHeartbeat)) and (key := event.node.public_key) and \
            event.node.node_id not in draft.nodes:
        removed = next((n for n, r in draft.revoked_nodes.items() if r.public_key == key), None)
        if removed is not None:
            raise Skip(f"node {event.node.node_id} registers with the key of removed node {removed}")


def on_node_removed(draft: Draft, event: NodeRemoved, seq: int) -> None:
    if event.node_id in draft.revoked_nodes:
        raise Skip(f"node {event.node_id} was removed already (event {draft.revoked_nodes[event.node_id].seq})")
    if event.node_id not in draft.nodes:
        raise Skip(f"unknown node {event.node_id}")
    del draft.own("nodes")[event.node_id]
    if event.node_id in draft.downloads:  # it reports none again: its models are no use to placement
        draft.drop_downloads_of(event.node_id)
    revoked = draft.own("revoked_nodes")
    revoked[event.node_id] = RevokedNode(public_key=event.public_key, seq=seq, reason=event.reason,
                                         removed_by=event.removed_by)
    while len(revoked) > MAX_REVOKED_NODES:  # oldest first: insertion order
        del revoked[next(iter(revoked))]


def find_nodes(state: State, asked: str) -> list[NodeId]:
    """The nodes in State that `asked` names: its id, its name (else hostname), or its short id as
    node names show it (at least SHORT_ID hex digits). More than one: the name is ambiguous."""
    if NodeId(asked) in state.nodes:
        return [NodeId(asked)]
    named = sorted(node_id for node_id, node in state.nodes.items() if node_label(node) == asked)
    if named or len(asked) < SHORT_ID:
        return named
    return sorted(node_id for node_id in state.nodes if node_id.startswith(asked))


def removal_of(state: State, node_id: NodeId, public_key: str) -> tuple[NodeId, RevokedNode] | None:
    """The removal that bars a node starting as `node_id` with `public_key`: its own, or that of the
    removed node whose key it holds (None: none)."""
    if (revoked := state.revoked_nodes.get(node_id)) is not None:
        return node_id, revoked
    return next(((n, r) for n, r in state.revoked_nodes.items() if public_key and r.public_key == public_key), None)


def removal_line(node_id: NodeId, revoked: RevokedNode) -> str:
    """The removed node's own account of it, for its log and its exit."""
    return (f"node {node_id} was removed from the cluster by {revoked.removed_by or 'an admin'}"
            f"{': ' + revoked.reason if revoked.reason else ''}")
