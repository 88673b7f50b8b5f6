"""EXO_LOAD_TIMEOUT_S on a request whose instance is placed but still loading (exo/api/loading.py):
a task that left the queue for a new instance (a migration from "", as when a placement scaled to
none brings a replica back) is bounded like one queued on it at once; a task moved off a dead
instance is not (its bounds are the master's: exo/master/heal.py)."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any, cast

import pytest

from exo.api.loading import LoadingWait
from exo.core.events import InstanceCreated, NodeRegistered, TaskCreated
from exo.core.ids import CommandId
from exo.core.types import Instance, Migration, NodeInfo, ShardAssignment, Task
from exo.settings.services import ApiSettings
from tests.support.as_master import fold

LOADING = "loading org/m on studio"


def _waiting_since(seconds_ago: float, migrations: list[Migration]) -> LoadingWait:
    instance = Instance(instance_id="i1", model_id="org/m", shards=[
        ShardAssignment(node_id="n1", runner_id="r1", rank=0, start_layer=0, end_layer=4)])
    task = Task(task_id="t", instance_id="i1", model_id="org/m", created_at=time.time() - seconds_ago,
                migrations=migrations)
    state = fold([NodeRegistered(node=NodeInfo(node_id="n1", name="studio")), InstanceCreated(instance=instance),
                  TaskCreated(task=task)])
    ctx = SimpleNamespace(view=SimpleNamespace(state=state), settings=ApiSettings(load_timeout_s=60.0))
    return LoadingWait(cast(Any, ctx), CommandId("t"))


@pytest.mark.parametrize("migrations", [[], [Migration(from_instance="", to_instance="i1")]],
                         ids=["queued-on-it", "left-the-queue-for-it"])
def test_a_request_on_an_instance_still_loading_ends_past_the_load_timeout(migrations: list[Migration]):
    assert _waiting_since(59.0, migrations)._waited_out(LOADING) == ""
    assert _waiting_since(61.0, migrations)._waited_out(LOADING).startswith(
        "no instance of 'org/m' was ready for it (waited 61 s, the most EXO_LOAD_TIMEOUT_S allows: loading org/m")


def test_a_task_moved_off_a_dead_instance_is_left_to_the_masters_bounds():
    moved = [Migration(from_instance="i0", to_instance="i1")]
    assert _waiting_since(600.0, moved)._waited_out(LOADING) == ""
