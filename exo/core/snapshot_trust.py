"""Whose State snapshots a starting node may use, from what the log shows (pure).

A snapshot is signed by the master that wrote it with its node key (exo/bus/snapshots.py). It is
used only if its signer led a term of the log it covers (an election the reducer accepts) and the
signature verifies against the first key that node's elections carried (a master puts its key in
every election it writes, `LeaderElected.public_key`). The snapshot's own State is never asked:
its content is what is being checked. Elections are few, so reading them is cheap; a node's
registrations are not read (every start and the bench's synthetic history write many).

An unsigned snapshot is used only while the log's latest leader has no key (an older master,
mid-upgrade, writes unsigned ones) or no master has led yet (the log, holding its start, shows
no election). A log trimmed past every election cannot check any signer: see `unverifiable`.
See docs/deploy.md, "Per-node identities".
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from exo.core.apply import fold_into
from exo.core.draft import Draft
from exo.core.events import LeaderElected
from exo.core.ids import NodeId
from exo.core.state import State


class SnapshotSigners(msgspec.Struct, frozen=True, kw_only=True):
    keys: dict[NodeId, str] = {}  # node -> the first key its elections carried
    leaders: frozenset[NodeId] = frozenset()  # nodes that led a term of the log
    current_leader: NodeId | None = None  # the latest accepted election's node
    trimmed_before: int = 0  # the log no longer holds the sequences before this one (0: it holds them all)


def snapshot_signers(group: str, elections: Sequence[tuple[int, LeaderElected]],
                     trimmed_before: int = 0) -> SnapshotSigners:
    """From the log's elections (sequence, event), folded by the reducer's own rules: an election
    the reducer skips (an old-scheme one after elections by sequence) makes no leader here either."""
    draft = Draft(State(group=group))
    leaders: set[NodeId] = set()
    keys: dict[NodeId, str] = {}
    for seq, election in sorted(elections, key=lambda e: e[0]):
        if fold_into(draft, election, seq):
            continue  # skipped by the reducer: no term
        leaders.add(election.node_id)
        if election.public_key and election.node_id not in keys:
            keys[election.node_id] = election.public_key  # the first key stays, as for chunks
    current = draft.leader_node
    return SnapshotSigners(keys=keys, leaders=frozenset(leaders), current_leader=NodeId(current) if current else None,
                           trimmed_before=trimmed_before)


def unverifiable(signers: SnapshotSigners) -> bool:
    """The log was trimmed past every election (EXO_EVENTS keeps 30 days): no signer can be checked,
    and the tail alone cannot rebuild State. Snapshots are then used as before they were signed
    (the caller warns): refusing them all would stop every late joiner until the next election."""
    return bool(signers.trimmed_before) and not signers.leaders


def snapshot_refusal(signers: SnapshotSigners, signer: str, signed: bool) -> str:
    """Why a snapshot claiming `signer` may not be used ("": it may, once its signature verifies
    against signers.keys[signer] when `signed`)."""
    if unverifiable(signers):
        return ""  # as before signatures: a node that cannot start would be worse (see unverifiable)
    gone = f" (the log starts at sequence {signers.trimmed_before}: older elections are gone)" \
        if signers.trimmed_before else ""
    if not signed:
        leader = signers.current_leader
        if leader is None and not gone:
            return ""  # no master has led yet
        if leader is None:
            return f"it is unsigned, and no election is left in the log to show a leader without a key{gone}"
        if not signers.keys.get(leader):
            return ""  # an older master without a key: its snapshots come unsigned
        return f"it is unsigned, and the log's leader {leader} has a key"
    if NodeId(signer) not in signers.leaders:
        return f"its signer {signer or '(none named)'} never led a term in the log{gone}"
    if not signers.keys.get(NodeId(signer)):
        return f"its signer {signer} has no key in the log"
    return ""
