"""The pure reducer: State x event -> State. The same function runs on every node and in replay.

It never raises on an event it cannot use: it records the event as skipped and moves on, so
one bad event cannot wedge a node. Ordering and gap checks belong to the log reader.

Every handler changes a `Draft` (exo/core/draft.py), a copy-on-write State. `apply` folds one
event through a draft; `apply_all` folds a whole batch through one draft, so each container is
copied at most once per batch instead of once per event. Same handlers, so the same State either
way. The handlers of tasks, and of cards, adapters and keys, live beside this module
(apply_tasks.py, apply_access.py).

A handler decides everything (and raises Skip) before it changes anything: a skipped event
leaves the draft as it was.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import Any, get_args

from msgspec.structs import replace

from exo.core.apply_access import (
    on_adapter_added,
    on_adapter_deleted,
    on_adapter_deleting,
    on_card_added,
    on_card_deleted,
    on_key_deleted,
    on_key_set,
)
from exo.core.apply_tasks import (
    on_task_cancel_requested,
    on_task_created,
    on_task_finished,
    on_task_migrated,
    on_task_started,
    stamp_desire_use,
)
from exo.core.draft import Draft
from exo.core.event_signers import SignatureCheck, check_signer, is_signed, note_signer
from exo.core.events import (
    AdapterAdded,
    AdapterDeleted,
    AdapterDeleting,
    AnyEvent,
    ClusterLayoutChanged,
    CommandRejected,
    CustomCardAdded,
    CustomCardDeleted,
    DesireEnded,
    DesireScaled,
    DesireSet,
    DownloadDeleted,
    DownloadFailed,
    DownloadProgressed,
    GroupsSet,
    InstanceCreated,
    InstanceDeleted,
    JoinTokenCreated,
    JoinTokenRedeemed,
    KeyDeleted,
    KeySet,
    LeaderElected,
    NodeHeartbeat,
    NodeRegistered,
    NodeRemoved,
    NodeSuspected,
    NodeTimedOut,
    RunnerStatusChanged,
    TaskCancelRequested,
    TaskCreated,
    TaskFinished,
    TaskMigrated,
    TaskStarted,
    command_id_of,
    event_tag,
)
from exo.core.groups import GROUP_KINDS, on_groups_set
from exo.core.join_tokens import on_token_created, on_token_redeemed
from exo.core.revocation import on_node_removed, refuse_if_revoked
from exo.core.skip import Skip
from exo.core.state import MAX_ANSWERED_COMMANDS, State
from exo.core.types import DownloadProgress, RunnerInfo

# The kinds only a master appends (exo/master): each must carry the leading term. Workers' kinds
# carry term 0 and are checked against what State knows instead (docs/reliability.md, "Who may
# write what").
MASTER_KINDS: frozenset[type] = frozenset({
    NodeTimedOut, NodeSuspected, InstanceCreated, InstanceDeleted, TaskCreated, TaskCancelRequested,
    CustomCardAdded, CustomCardDeleted, AdapterAdded, AdapterDeleted, KeySet, KeyDeleted, CommandRejected, DesireSet,
    DesireEnded, AdapterDeleting, DesireScaled, TaskMigrated, GroupsSet, NodeRemoved, JoinTokenCreated, JoinTokenRedeemed,
})


def apply(state: State, event: AnyEvent, seq: int, verify: SignatureCheck | None = None) -> State:
    """`verify`: whether the event's message was signed by a key (exo/core/event_signers.py); None:
    the caller appended it itself, and nothing is checked."""
    draft = Draft(state)
    fold_into(draft, event, seq, verify)
    return draft.state()


def apply_all(state: State, events: Iterable[tuple[AnyEvent, int]]) -> State:
    """The State after folding each (event, sequence) in order: the same State as calling
    `apply` for each, with each container copied at most once."""
    draft = Draft(state)
    for event, seq in events:
        fold_into(draft, event, seq)
    return draft.state()


def was_skipped(state: State, seq: int) -> bool:
    """Whether event `seq`, the latest one folded into `state`, was skipped rather than used."""
    return bool(state.skipped_events) and state.skipped_events[-1].seq == seq


def skip_event(state: State, seq: int, reason: str) -> State:
    """Advance past an event that cannot be used, keeping a bounded record of why."""
    draft = Draft(state)
    draft.skip(seq, reason)
    return draft.state()


def fold_into(draft: Draft, event: AnyEvent, seq: int, verify: SignatureCheck | None = None) -> str:
    """Fold one event into the draft; returns why it was skipped, or "" if it was used."""
    try:
        if draft.group and type(event) not in GROUP_KINDS:
            raise Skip(f"a {event_tag(event)} event in master group {draft.group}'s log, which holds requests only")
        by_master = type(event) in MASTER_KINDS or bool(event.term and not isinstance(event, LeaderElected))
        if by_master:
            _check_term(draft, event.term)
        if draft.revoked_nodes:
            refuse_if_revoked(draft, event)
        check = verify if verify is not None and is_signed(event) else None  # a request's own: none asked
        if check is not None:
            check_signer(draft, event, check, by_master)
        _HANDLERS[type(event)](draft, event, seq)
        if check is not None or isinstance(event, LeaderElected):
            note_signer(draft, event, verify)
    except Skip as skip:
        reason = str(skip)
        draft.skip(seq, reason)
        return reason
    if command_id := command_id_of(event):
        answered = draft.own("answered_commands")
        answered[command_id] = seq
        if len(answered) > MAX_ANSWERED_COMMANDS:
            del answered[next(iter(answered))]
    draft.last_seq = seq
    return ""


def _check_term(draft: Draft, term: int) -> None:
    if not term:  # a master always stamps its term: 0 is a stray publisher (or a bug), never a master
        raise Skip("a master's event without a term")
    if draft.leader_by_sequence and term != draft.leader_term:
        raise Skip(f"from term {term}, not the leader's term {draft.leader_term}")
    if term < draft.leader_term:
        raise Skip(f"from term {term}, older than the leader's term {draft.leader_term}")


def _on_leader_elected(draft: Draft, event: LeaderElected, seq: int) -> None:
    if event.lease_revision:  # the latest election wins; its term is its sequence
        draft.leader_term, draft.leader_node, draft.leader_by_sequence = seq, event.node_id, True
        return
    if draft.leader_by_sequence:  # an old-scheme election (a term anyone can write) after the new scheme began
        raise Skip(f"an election without a lease revision (term {event.term}) after elections by sequence")
    if event.term <= draft.leader_term:
        raise Skip(f"leader term {event.term} is not newer than {draft.leader_term}")
    draft.leader_term, draft.leader_node = event.term, event.node_id


def _on_node_registered(draft: Draft, event: NodeRegistered | NodeHeartbeat, seq: int) -> None:
    node, known = event.node, draft.nodes.get(event.node.node_id)
    # Only the master marks a node suspect or clears it: a node's own description keeps State's mark.
    kept = known.suspect_since if known is not None else 0.0
    # Trust on first use: the first key stays, so a forged registration cannot swap in a key of its
    # own (or none) to sign chunks as this node; the rest of the event is folded as ever.
    key = known.public_key if known is not None and known.public_key else node.public_key
    signs = known is not None and known.signs_events  # the reducer's to set (exo/core/event_signers.py)
    if node.suspect_since != kept or node.public_key != key or node.signs_events != signs:
        node = replace(node, suspect_since=kept, public_key=key, signs_events=signs)
    draft.own("nodes")[node.node_id] = node


def _on_node_suspected(draft: Draft, event: NodeSuspected, seq: int) -> None:
    node = draft.nodes.get(event.node_id)
    if node is None:
        raise Skip(f"unknown node {event.node_id}")
    if event.suspect and event.at <= 0:
        raise Skip(f"node {event.node_id} marked suspect without the time")
    if event.suspect == bool(node.suspect_since):
        raise Skip(f"node {event.node_id} is {'already' if event.suspect else 'not'} suspect")
    draft.own("nodes")[event.node_id] = replace(node, suspect_since=event.at if event.suspect else 0.0)


def _on_node_timed_out(draft: Draft, event: NodeTimedOut, seq: int) -> None:
    if event.node_id not in draft.nodes:
        raise Skip(f"unknown node {event.node_id}")
    del draft.own("nodes")[event.node_id]


def _on_instance_created(draft: Draft, event: InstanceCreated, seq: int) -> None:
    instance = replace(event.instance, created_seq=seq)
    if instance.instance_id in draft.instances:
        raise Skip(f"instance {instance.instance_id} already exists")
    runners = draft.own("runners")
    for shard in instance.shards:
        runners[shard.runner_id] = RunnerInfo(
            runner_id=shard.runner_id, instance_id=instance.instance_id, node_id=shard.node_id
        )
    draft.own("instances")[instance.instance_id] = instance


def _on_instance_deleted(draft: Draft, event: InstanceDeleted, seq: int) -> None:
    if event.instance_id not in draft.instances:
        raise Skip(f"unknown instance {event.instance_id}")
    instances = draft.own("instances")
    model_id = instances.pop(event.instance_id).model_id
    runners = draft.own("runners")
    for runner_id in [k for k, v in runners.items() if v.instance_id == event.instance_id]:
        del runners[runner_id]
    draft.own("instance_end_reasons")[model_id] = event.reason or "deleted"


def _on_runner_status(draft: Draft, event: RunnerStatusChanged, seq: int) -> None:
    runner = draft.runners.get(event.runner_id)
    if runner is None:
        raise Skip(f"unknown runner {event.runner_id}")
    if (event.node_id, event.instance_id) != (runner.node_id, runner.instance_id):
        raise Skip(f"runner {event.runner_id} runs on node {runner.node_id} for instance {runner.instance_id}, "
                    f"not on {event.node_id} for {event.instance_id}")
    updated = replace(runner, status=event.status, error=event.error, failures=event.failures,
                      prefill_address=_prefill_address(event))
    draft.own("runners")[event.runner_id] = updated
    if event.status == "ready" and (instance := draft.instances.get(runner.instance_id)) is not None:
        stamp_desire_use(draft, instance.desire_id, event.at)  # a model that took long to load is not idle yet


_HOST = re.compile(r"[A-Za-z0-9.-]+|\[[0-9A-Fa-f:.]+\]")  # a name, an IPv4 address or a bracketed IPv6 one


def _prefill_address(event: RunnerStatusChanged) -> str:
    """A ready runner's "host:port", if it is one: it names where decode runners connect (they check
    the cache's signature by the node's key, so a wrong one costs a fallback, never a wrong text)."""
    address = event.prefill_address
    host, _, port = address.rpartition(":")
    fine = event.status == "ready" and len(address) <= 128 and bool(_HOST.fullmatch(host)) and port.isdigit() \
        and 0 < int(port) < 65536
    return address if fine else ""


def _on_desire_set(draft: Draft, event: DesireSet, seq: int) -> None:
    _check_replicas(event.desire.desire_id, event.desire.replicas, event.desire.min_replicas)
    draft.own("desires")[event.desire.desire_id] = event.desire


def _check_replicas(desire_id: str, replicas: int, min_replicas: int | None) -> None:
    """No replicas only for a desire allowed to scale to none (min_replicas 0): it keeps its bounds."""
    if replicas < (0 if min_replicas == 0 else 1):
        raise Skip(f"desire {desire_id}: replicas must be at least {0 if min_replicas == 0 else 1}, not {replicas}")


def _on_desire_scaled(draft: Draft, event: DesireScaled, seq: int) -> None:
    desire = draft.desires.get(event.desire_id)
    if desire is None:
        raise Skip(f"unknown desire {event.desire_id}")
    if desire.replicas != event.from_replicas:
        raise Skip(f"desire {event.desire_id} has {desire.replicas} replicas, not {event.from_replicas}")
    _check_replicas(event.desire_id, event.to_replicas, desire.min_replicas)
    # A step starts a new window: the pressure that led to it is spent.
    draft.own("desires")[event.desire_id] = replace(desire, replicas=event.to_replicas, last_scaled_at=event.at,
                                                    pressure_since=0.0)


def _on_desire_ended(draft: Draft, event: DesireEnded, seq: int) -> None:
    if event.desire_id not in draft.desires:
        raise Skip(f"unknown desire {event.desire_id}")
    del draft.own("desires")[event.desire_id]


def _on_command_rejected(draft: Draft, event: CommandRejected, seq: int) -> None:
    pass  # an answer to a caller; State does not change


def _on_download_progressed(draft: Draft, event: DownloadProgressed, seq: int) -> None:
    _set_download(draft, event.progress)


def _set_download(draft: Draft, progress: DownloadProgress) -> None:
    draft.own_downloads_of(progress.node_id)[progress.model_id] = progress


def _on_download_failed(draft: Draft, event: DownloadFailed, seq: int) -> None:
    # Keep what the last progress said (bytes done, files): a retry resumes from there.
    previous = draft.downloads.get(event.node_id, {}).get(event.model_id) or DownloadProgress(
        node_id=event.node_id, model_id=event.model_id
    )
    _set_download(draft, replace(
        previous, status="failed", error_code=event.code, error=event.reason, speed_bps=0.0, eta_s=None,
        updated_at=event.at,
    ))


def _on_download_deleted(draft: Draft, event: DownloadDeleted, seq: int) -> None:
    if event.model_id not in draft.downloads.get(event.node_id, {}):
        raise Skip(f"no download of {event.model_id} on node {event.node_id}")
    remaining = draft.own_downloads_of(event.node_id)
    del remaining[event.model_id]
    if not remaining:
        draft.drop_downloads_of(event.node_id)


def _on_cluster_layout(draft: Draft, event: ClusterLayoutChanged, seq: int) -> None:
    draft.cluster = event.layout


_HANDLERS: dict[type, Callable[[Draft, Any, int], None]] = {
    LeaderElected: _on_leader_elected,
    NodeRegistered: _on_node_registered,
    NodeHeartbeat: _on_node_registered,
    NodeTimedOut: _on_node_timed_out,
    NodeRemoved: on_node_removed,
    JoinTokenCreated: lambda draft, event, seq: on_token_created(draft, event.token),
    JoinTokenRedeemed: lambda draft, event, seq: on_token_redeemed(draft, event.token_id, event.secret_sha256,
                                                                   event.node_name, event.at),
    NodeSuspected: _on_node_suspected,
    InstanceCreated: _on_instance_created,
    InstanceDeleted: _on_instance_deleted,
    RunnerStatusChanged: _on_runner_status,
    TaskCreated: on_task_created,
    TaskCancelRequested: on_task_cancel_requested,
    TaskStarted: on_task_started,
    TaskFinished: on_task_finished,
    CustomCardAdded: on_card_added,
    CustomCardDeleted: on_card_deleted,
    AdapterAdded: on_adapter_added,
    AdapterDeleted: on_adapter_deleted,
    AdapterDeleting: on_adapter_deleting,
    KeySet: on_key_set,
    KeyDeleted: on_key_deleted,
    CommandRejected: _on_command_rejected,
    DownloadProgressed: _on_download_progressed,
    DownloadFailed: _on_download_failed,
    DownloadDeleted: _on_download_deleted,
    ClusterLayoutChanged: _on_cluster_layout,
    DesireSet: _on_desire_set,
    DesireEnded: _on_desire_ended,
    DesireScaled: _on_desire_scaled,
    TaskMigrated: on_task_migrated,
    GroupsSet: on_groups_set,
}
# Checked once at import: a new event kind needs a handler.
if set(_HANDLERS) != set(get_args(AnyEvent)):
    raise TypeError(f"the reducer has no handler for {set(get_args(AnyEvent)) - set(_HANDLERS)}")
