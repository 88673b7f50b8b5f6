"""The pure reducer: State x event -> State. The same function runs on every node and in replay.

It never raises on an event it cannot use: it records the event as skipped and moves on, so
one bad event cannot wedge a node. Ordering and gap checks belong to the log reader.

Every handler changes a `Draft`: State's fields, each container (dict or list) copied the
first time it changes and changed in place after that, so the State a draft started from is
never touched. `apply` folds one event through a draft; `apply_all` folds a whole batch
through one draft, so each container is copied at most once per batch instead of once per
event (a replay of a million events). Same handlers, so the same State either way.

A handler decides everything (and raises _Skip) before it changes anything: a skipped event
leaves the draft as it was.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, get_args

from msgspec.structs import replace

from exo.core.apply_access import (
    count_request,
    count_tokens,
    on_adapter_added,
    on_adapter_deleted,
    on_card_added,
    on_card_deleted,
    on_key_deleted,
    on_key_set,
)
from exo.core.conversation import digest_conversation, without_text
from exo.core.events import (
    AdapterAdded,
    AdapterDeleted,
    AnyEvent,
    ClusterLayoutChanged,
    CommandRejected,
    CustomCardAdded,
    CustomCardDeleted,
    DesireEnded,
    DesireSet,
    DownloadDeleted,
    DownloadFailed,
    DownloadProgressed,
    GroupsSet,
    InstanceCreated,
    InstanceDeleted,
    KeyDeleted,
    KeySet,
    LeaderElected,
    NodeHeartbeat,
    NodeRegistered,
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
from exo.core.ids import NodeId, TaskId
from exo.core.skip import Skip
from exo.core.state import MAX_ANSWERED_COMMANDS, MAX_FINISHED_TASKS, MAX_SKIPPED_KEPT, SkippedEvent, State
from exo.core.types import DownloadProgress, Migration, RunnerInfo, Task

# The kinds only a master appends (exo/master): each must carry the leading term. Workers' kinds
# carry term 0 and are checked against what State knows instead (docs/reliability.md, "Who may
# write what").
MASTER_KINDS: frozenset[type] = frozenset({
    NodeTimedOut, InstanceCreated, InstanceDeleted, TaskCreated, TaskCancelRequested,
    CustomCardAdded, CustomCardDeleted, AdapterAdded, AdapterDeleted, KeySet, KeyDeleted, CommandRejected, DesireSet,
    DesireEnded, TaskMigrated, GroupsSet,
})


_Skip = Skip

def apply(state: State, event: AnyEvent, seq: int) -> State:
    draft = Draft(state)
    draft.apply(event, seq)
    return draft.state()


def apply_all(state: State, events: Iterable[tuple[AnyEvent, int]]) -> State:
    """The State after folding each (event, sequence) in order: the same State as calling
    `apply` for each, with each container copied at most once."""
    draft = Draft(state)
    for event, seq in events:
        draft.apply(event, seq)
    return draft.state()


def was_skipped(state: State, seq: int) -> bool:
    """Whether event `seq`, the latest one folded into `state`, was skipped rather than used."""
    return bool(state.skipped_events) and state.skipped_events[-1].seq == seq


def skip_event(state: State, seq: int, reason: str) -> State:
    """Advance past an event that cannot be used, keeping a bounded record of why."""
    draft = Draft(state)
    draft.skip(seq, reason)
    return draft.state()


class Draft:
    """A State being changed in place, copy on first write (see the module's docstring)."""

    # Listed by hand: this runs for every event folded (~4.6 us per Draft built from State's field
    # list vs 0.7 us written out). tests/test_fold.py fails if a State field is missing here.
    __slots__ = (
        "_base", "_own_downloads_of", "last_seq", "leader_term", "leader_node", "leader_by_sequence", "nodes", "instances",
        "runners",
        "tasks", "custom_model_cards", "skipped_events", "finished_task_ids", "answered_commands", "downloads",
        "instance_end_reasons", "cluster", "desires", "migrations_total", "adapters", "api_keys", "key_windows", "usage",
        "usage_totals", "group", "groups", "group_logs",
    )

    def __init__(self, state: State) -> None:
        self._base = state  # the State the containers are shared with until they change
        self._own_downloads_of: set[str] = set()  # node ids whose inner map this draft copied
        self.last_seq = state.last_seq
        self.leader_term = state.leader_term
        self.leader_node = state.leader_node
        self.leader_by_sequence = state.leader_by_sequence
        self.nodes = state.nodes
        self.instances = state.instances
        self.runners = state.runners
        self.tasks = state.tasks
        self.custom_model_cards = state.custom_model_cards
        self.skipped_events = state.skipped_events
        self.finished_task_ids = state.finished_task_ids
        self.answered_commands = state.answered_commands
        self.downloads = state.downloads
        self.instance_end_reasons = state.instance_end_reasons
        self.cluster = state.cluster
        self.desires = state.desires
        self.migrations_total = state.migrations_total
        self.adapters = state.adapters
        self.api_keys = state.api_keys
        self.key_windows = state.key_windows
        self.usage = state.usage
        self.usage_totals = state.usage_totals
        self.group = state.group
        self.groups = state.groups
        self.group_logs = state.group_logs

    def state(self) -> State:
        """The State so far. The draft can go on: from here it copies again what it changes."""
        state = State(
            last_seq=self.last_seq, leader_term=self.leader_term, leader_node=self.leader_node,
            leader_by_sequence=self.leader_by_sequence, nodes=self.nodes,
            instances=self.instances, runners=self.runners, tasks=self.tasks,
            custom_model_cards=self.custom_model_cards, skipped_events=self.skipped_events,
            finished_task_ids=self.finished_task_ids, answered_commands=self.answered_commands,
            downloads=self.downloads, instance_end_reasons=self.instance_end_reasons, cluster=self.cluster,
            desires=self.desires, migrations_total=self.migrations_total, adapters=self.adapters,
            api_keys=self.api_keys, key_windows=self.key_windows, usage=self.usage, usage_totals=self.usage_totals,
            group=self.group, groups=self.groups, group_logs=self.group_logs,
        )
        self._base = state
        self._own_downloads_of = set()
        return state

    def own(self, field: str) -> Any:
        """The field's container, copied first if it is still the one the base State holds."""
        value = getattr(self, field)
        if value is getattr(self._base, field):
            value = value.copy()
            setattr(self, field, value)
        return value

    def own_downloads_of(self, node_id: NodeId) -> dict[str, DownloadProgress]:
        downloads: dict[str, dict[str, DownloadProgress]] = self.own("downloads")
        if node_id not in self._own_downloads_of:
            downloads[node_id] = dict(downloads.get(node_id, {}))
            self._own_downloads_of.add(node_id)
        return downloads[node_id]

    def apply(self, event: AnyEvent, seq: int) -> str:
        """Fold one event in; returns why it was skipped, or "" if it was used."""
        try:
            if self.group and type(event) not in GROUP_KINDS:
                raise _Skip(f"a {event_tag(event)} event in master group {self.group}'s log, which holds requests only")
            if type(event) in MASTER_KINDS or (event.term and not isinstance(event, LeaderElected)):
                self._check_term(event.term)
            _HANDLERS[type(event)](self, event, seq)
        except _Skip as skip:
            reason = str(skip)
            self.skip(seq, reason)
            return reason
        if command_id := command_id_of(event):
            answered = self.own("answered_commands")
            answered[command_id] = seq
            if len(answered) > MAX_ANSWERED_COMMANDS:
                del answered[next(iter(answered))]
        self.last_seq = seq
        return ""

    def _check_term(self, term: int) -> None:
        if not term:  # a master always stamps its term: 0 is a stray publisher (or a bug), never a master
            raise _Skip("a master's event without a term")
        if self.leader_by_sequence and term != self.leader_term:
            raise _Skip(f"from term {term}, not the leader's term {self.leader_term}")
        if term < self.leader_term:
            raise _Skip(f"from term {term}, older than the leader's term {self.leader_term}")

    def skip(self, seq: int, reason: str) -> None:
        """Advance past an event that cannot be used, keeping a bounded record of why."""
        skipped = self.own("skipped_events")
        skipped.append(SkippedEvent(seq=seq, reason=reason))
        del skipped[:-MAX_SKIPPED_KEPT]
        self.last_seq = seq


def _on_leader_elected(draft: Draft, event: LeaderElected, seq: int) -> None:
    if event.lease_revision:  # the latest election wins; its term is its sequence
        draft.leader_term, draft.leader_node, draft.leader_by_sequence = seq, event.node_id, True
        return
    if draft.leader_by_sequence:  # an old-scheme election (a term anyone can write) after the new scheme began
        raise _Skip(f"an election without a lease revision (term {event.term}) after elections by sequence")
    if event.term <= draft.leader_term:
        raise _Skip(f"leader term {event.term} is not newer than {draft.leader_term}")
    draft.leader_term, draft.leader_node = event.term, event.node_id


def _on_node_registered(draft: Draft, event: NodeRegistered | NodeHeartbeat, seq: int) -> None:
    draft.own("nodes")[event.node.node_id] = event.node


def _on_node_timed_out(draft: Draft, event: NodeTimedOut, seq: int) -> None:
    if event.node_id not in draft.nodes:
        raise _Skip(f"unknown node {event.node_id}")
    del draft.own("nodes")[event.node_id]


def _on_instance_created(draft: Draft, event: InstanceCreated, seq: int) -> None:
    instance = replace(event.instance, created_seq=seq)
    if instance.instance_id in draft.instances:
        raise _Skip(f"instance {instance.instance_id} already exists")
    runners = draft.own("runners")
    for shard in instance.shards:
        runners[shard.runner_id] = RunnerInfo(
            runner_id=shard.runner_id, instance_id=instance.instance_id, node_id=shard.node_id
        )
    draft.own("instances")[instance.instance_id] = instance


def _on_instance_deleted(draft: Draft, event: InstanceDeleted, seq: int) -> None:
    if event.instance_id not in draft.instances:
        raise _Skip(f"unknown instance {event.instance_id}")
    instances = draft.own("instances")
    model_id = instances.pop(event.instance_id).model_id
    runners = draft.own("runners")
    for runner_id in [k for k, v in runners.items() if v.instance_id == event.instance_id]:
        del runners[runner_id]
    draft.own("instance_end_reasons")[model_id] = event.reason or "deleted"


def _on_runner_status(draft: Draft, event: RunnerStatusChanged, seq: int) -> None:
    runner = draft.runners.get(event.runner_id)
    if runner is None:
        raise _Skip(f"unknown runner {event.runner_id}")
    if (event.node_id, event.instance_id) != (runner.node_id, runner.instance_id):
        raise _Skip(f"runner {event.runner_id} runs on node {runner.node_id} for instance {runner.instance_id}, "
                    f"not on {event.node_id} for {event.instance_id}")
    updated = replace(runner, status=event.status, error=event.error, failures=event.failures)
    draft.own("runners")[event.runner_id] = updated


def _on_task_created(draft: Draft, event: TaskCreated, seq: int) -> None:
    if event.task.task_id in draft.tasks:
        raise _Skip(f"task {event.task.task_id} already exists")
    task = event.task
    draft.own("tasks")[task.task_id] = replace(task, conversation=digest_conversation(task.params))
    count_request(draft, task)


def _open_task(draft: Draft, task_id: TaskId) -> Task:
    task = draft.tasks.get(task_id)
    if task is None:
        raise _Skip(f"unknown task {task_id}")
    if task.status not in ("pending", "running"):
        raise _Skip(f"task {task_id} already {task.status}")
    return task


def _on_task_cancel_requested(draft: Draft, event: TaskCancelRequested, seq: int) -> None:
    task = _open_task(draft, event.task_id)
    draft.own("tasks")[event.task_id] = replace(task, cancel_requested=True)


def _on_task_started(draft: Draft, event: TaskStarted, seq: int) -> None:
    task = _open_task(draft, event.task_id)
    _check_attempt(task, event.attempt, "start")
    draft.own("tasks")[event.task_id] = replace(task, status="running")


def _check_attempt(task: Task, attempt: int, what: str) -> None:
    """A worker speaks for the task's current run only: a run it migrated away from (a node that
    paused, then woke) cannot start or end it."""
    if attempt != len(task.migrations):
        raise _Skip(f"task {task.task_id}: the {what} of run {attempt}, but it is on run {len(task.migrations)}")


def _on_task_migrated(draft: Draft, event: TaskMigrated, seq: int) -> None:
    task = _open_task(draft, event.task_id)
    if event.to_instance and not draft.group:  # a group's log holds no instances: its master checked the shared log
        if event.to_instance not in draft.instances:
            raise _Skip(f"task {event.task_id}: unknown instance {event.to_instance}")
        if draft.instances[event.to_instance].model_id != task.model_id:
            raise _Skip(f"task {event.task_id}: instance {event.to_instance} serves another model")
    moved = Migration(from_instance=task.instance_id, to_instance=event.to_instance, reason=event.reason, at=event.at)
    waiting_already = not task.instance_id and task.migrations  # from waiting to an instance: the same move
    migrations = [*task.migrations[:-1], replace(task.migrations[-1], to_instance=event.to_instance)] \
        if waiting_already else [*task.migrations, moved]
    draft.own("tasks")[event.task_id] = replace(task, instance_id=event.to_instance, status="pending",
                                                migrations=migrations)
    if not waiting_already:
        draft.migrations_total += 1


def _on_desire_set(draft: Draft, event: DesireSet, seq: int) -> None:
    if event.desire.replicas < 1:
        raise _Skip(f"desire {event.desire.desire_id}: replicas must be at least 1")
    draft.own("desires")[event.desire.desire_id] = event.desire


def _on_desire_ended(draft: Draft, event: DesireEnded, seq: int) -> None:
    if event.desire_id not in draft.desires:
        raise _Skip(f"unknown desire {event.desire_id}")
    del draft.own("desires")[event.desire_id]


def _on_task_finished(draft: Draft, event: TaskFinished, seq: int) -> None:
    """Finish the task, and keep State bounded: only the most recent MAX_FINISHED_TASKS
    finished tasks stay."""
    task = _open_task(draft, event.task_id)
    if not event.term:  # a worker's: the master ends a task whatever run it is on
        _check_attempt(task, event.attempt, "end")
    tasks = draft.own("tasks")
    tasks[event.task_id] = replace(
        task, params=without_text(task.params),  # the text stays in the log; State keeps its digest
        status=event.status, finish_reason=event.finish_reason, error=event.error,
        prompt_tokens=event.prompt_tokens, completion_tokens=event.completion_tokens,
        cached_tokens=event.cached_tokens,
    )
    count_tokens(draft, task, event)
    order = draft.own("finished_task_ids")
    order.append(event.task_id)
    if len(order) > MAX_FINISHED_TASKS:
        tasks.pop(order[0], None)
        del order[0]


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
        raise _Skip(f"no download of {event.model_id} on node {event.node_id}")
    remaining = draft.own_downloads_of(event.node_id)
    del remaining[event.model_id]
    if not remaining:
        del draft.downloads[event.node_id]
        draft._own_downloads_of.discard(event.node_id)


def _on_cluster_layout(draft: Draft, event: ClusterLayoutChanged, seq: int) -> None:
    draft.cluster = event.layout


_HANDLERS: dict[type, Callable[[Draft, Any, int], None]] = {
    LeaderElected: _on_leader_elected,
    NodeRegistered: _on_node_registered,
    NodeHeartbeat: _on_node_registered,
    NodeTimedOut: _on_node_timed_out,
    InstanceCreated: _on_instance_created,
    InstanceDeleted: _on_instance_deleted,
    RunnerStatusChanged: _on_runner_status,
    TaskCreated: _on_task_created,
    TaskCancelRequested: _on_task_cancel_requested,
    TaskStarted: _on_task_started,
    TaskFinished: _on_task_finished,
    CustomCardAdded: on_card_added,
    CustomCardDeleted: on_card_deleted,
    AdapterAdded: on_adapter_added,
    AdapterDeleted: on_adapter_deleted,
    KeySet: on_key_set,
    KeyDeleted: on_key_deleted,
    CommandRejected: _on_command_rejected,
    DownloadProgressed: _on_download_progressed,
    DownloadFailed: _on_download_failed,
    DownloadDeleted: _on_download_deleted,
    ClusterLayoutChanged: _on_cluster_layout,
    DesireSet: _on_desire_set,
    DesireEnded: _on_desire_ended,
    TaskMigrated: _on_task_migrated,
    GroupsSet: on_groups_set,
}
# Checked once at import: a new event kind needs a handler, a new State field a place in the Draft.
if set(_HANDLERS) != set(get_args(AnyEvent)):
    raise TypeError(f"the reducer has no handler for {set(get_args(AnyEvent)) - set(_HANDLERS)}")
if set(Draft.__slots__[2:]) != set(State.__struct_fields__):
    raise TypeError(f"Draft does not carry State's fields {set(State.__struct_fields__) - set(Draft.__slots__)}")
