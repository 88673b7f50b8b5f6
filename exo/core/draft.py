"""The reducer's working copy of State (exo/core/apply.py folds events into it).

A `Draft` holds State's fields, each container (dict or list) copied the first time it changes
and changed in place after that, so the State a draft started from is never touched. Folding a
whole batch through one draft copies each container at most once per batch instead of once per
event (a replay of a million events).
"""

from __future__ import annotations

from typing import Any

from exo.core.ids import NodeId
from exo.core.state import MAX_SKIPPED_KEPT, SkippedEvent, State
from exo.core.types import DownloadProgress


class Draft:
    """A State being changed in place, copy on first write (see the module's docstring)."""

    # Listed by hand: this runs for every event folded (~4.6 us per Draft built from State's field
    # list vs 0.7 us written out). tests/test_fold.py fails if a State field is missing here.
    __slots__ = (
        "_base", "_own_downloads_of", "last_seq", "leader_term", "leader_node", "leader_by_sequence", "leader_key",
        "nodes", "instances",
        "runners",
        "tasks", "custom_model_cards", "skipped_events", "finished_task_ids", "answered_commands", "downloads",
        "instance_end_reasons", "cluster", "desires", "migrations_total", "adapters", "api_keys", "key_windows", "usage",
        "usage_totals", "group", "groups", "group_logs", "revoked_nodes", "join_tokens",
    )

    def __init__(self, state: State) -> None:
        self._base = state  # the State the containers are shared with until they change
        self._own_downloads_of: set[str] = set()  # node ids whose inner map this draft copied
        self.last_seq = state.last_seq
        self.leader_term = state.leader_term
        self.leader_node = state.leader_node
        self.leader_by_sequence = state.leader_by_sequence
        self.leader_key = state.leader_key
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
        self.revoked_nodes = state.revoked_nodes
        self.join_tokens = state.join_tokens

    def state(self) -> State:
        """The State so far. The draft can go on: from here it copies again what it changes."""
        state = State(
            last_seq=self.last_seq, leader_term=self.leader_term, leader_node=self.leader_node,
            leader_by_sequence=self.leader_by_sequence, leader_key=self.leader_key,
            nodes=self.nodes,
            instances=self.instances, runners=self.runners, tasks=self.tasks,
            custom_model_cards=self.custom_model_cards, skipped_events=self.skipped_events,
            finished_task_ids=self.finished_task_ids, answered_commands=self.answered_commands,
            downloads=self.downloads, instance_end_reasons=self.instance_end_reasons, cluster=self.cluster,
            desires=self.desires, migrations_total=self.migrations_total, adapters=self.adapters,
            api_keys=self.api_keys, key_windows=self.key_windows, usage=self.usage, usage_totals=self.usage_totals,
            group=self.group, groups=self.groups, group_logs=self.group_logs, revoked_nodes=self.revoked_nodes,
            join_tokens=self.join_tokens,
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

    def drop_downloads_of(self, node_id: NodeId) -> None:
        """Forget a node's map of downloads; a later change starts it afresh."""
        del self.own("downloads")[node_id]
        self._own_downloads_of.discard(node_id)

    def skip(self, seq: int, reason: str) -> None:
        """Advance past an event that cannot be used, keeping a bounded record of why."""
        skipped = self.own("skipped_events")
        skipped.append(SkippedEvent(seq=seq, reason=reason))
        del skipped[:-MAX_SKIPPED_KEPT]
        self.last_seq = seq


# Checked once at import: a new State field needs a place in the Draft.
if set(Draft.__slots__[2:]) != set(State.__struct_fields__):
    raise TypeError(f"Draft does not carry State's fields {set(State.__struct_fields__) - set(Draft.__slots__)}")
