"""What a runner's prompt cache holds, as its node tells the master: one entry per request whose
end stored it (by that request's task id), and the tasks whose entries are gone. The master routes
by State's record of which instance served which conversation (exo/master/routing.py); a report
only takes away what an instance no longer holds (docs/prompt-cache.md, "What each cache holds").

Reports reach the master on core NATS (exo/bus/cache_reports.py), where anyone with the cluster's
credentials may publish: decoding is strict (a tag, no unknown fields, bounded lists and ids).
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from exo.core.ids import InstanceId, NodeId, RunnerId, TaskId
from exo.core.state import State
from exo.core.types import Instance, ShardAssignment

MAX_HELD = 4096  # entries a report lists (a runner holds EXO_PROMPT_CACHE_ENTRIES, 10 by default)
MAX_DROPPED = 4096  # tasks whose entries are gone: State keeps 1,000 finished tasks, more is no use
MAX_ID_CHARS = 256
MAX_REPORT_BYTES = 1 << 20  # what the master reads of one message at most

BoundedTaskId = Annotated[TaskId, msgspec.Meta(max_length=MAX_ID_CHARS)]


class HeldEntry(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One entry of the cache: the request whose end stored it, and how many tokens it holds."""

    task_id: BoundedTaskId
    tokens: Annotated[int, msgspec.Meta(ge=0)] = 0


class CacheContents(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A runner's whole cache now: a snapshot, not a change, so a lost report costs nothing."""

    held: Annotated[list[HeldEntry], msgspec.Meta(max_length=MAX_HELD)] = []
    # The latest tasks (oldest first) whose entry was evicted, replaced by a longer one of the same
    # conversation, or never stored (a cache turned off, one whose layers cannot say their length).
    dropped: Annotated[list[BoundedTaskId], msgspec.Meta(max_length=MAX_DROPPED)] = []


EMPTY = CacheContents()


class CacheReport(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True,
                  tag_field="kind", tag="cache_report"):
    """A node's word on the cache of an instance's rank 0 runner, which runs there."""

    instance_id: Annotated[InstanceId, msgspec.Meta(max_length=MAX_ID_CHARS)]
    node_id: Annotated[NodeId, msgspec.Meta(max_length=MAX_ID_CHARS)]
    runner_id: Annotated[RunnerId, msgspec.Meta(max_length=MAX_ID_CHARS)]
    contents: CacheContents = EMPTY


report_decoder = msgspec.json.Decoder(CacheReport)


def rank_zero(instance: Instance) -> ShardAssignment | None:
    """The shard whose runner decides what the instance caches (the other ranks follow it)."""
    return next((shard for shard in instance.shards if shard.rank == 0), None)


def speaks_for(state: State, report: CacheReport) -> bool:
    """Whether `report` comes from where State says its instance's rank 0 runs: its node and runner.
    A report of another node, of a runner no longer there, or of an instance State does not have is
    not this instance's cache (it may be an older placement's, or forged)."""
    instance = state.instances.get(report.instance_id)
    shard = rank_zero(instance) if instance is not None else None
    return shard is not None and (shard.node_id, shard.runner_id) == (report.node_id, report.runner_id)
