"""Replicas that follow the load (exo/master/autoscale.py): a desire with min_replicas and
max_replicas gains a replica once its queue stays above EXO_SCALE_QUEUE per ready replica for
EXO_SCALE_WINDOW_S, and loses one, never one with work, after EXO_SCALE_IDLE_S without tasks.
Pure (supervise() with `now` passed in), plus the decision landing in a real nats-server's log."""

from __future__ import annotations

import asyncio
import itertools
import json
from pathlib import Path
from types import SimpleNamespace

import msgspec
import pytest
from aiohttp import web
from aiohttp.base_protocol import BaseProtocol
from aiohttp.streams import StreamReader
from aiohttp.test_utils import make_mocked_request

from exo.api.cluster import instances as instances_route
from exo.api.context import CONTEXT_KEY, ApiContext
from exo.api.errors import ApiError
from exo.bus.command_queue import send_command
from exo.bus.connection import connect
from exo.bus.event_log import EventLog
from exo.bus.provision import provision
from exo.core.commands import DeleteInstance, GenerateText, PlaceInstance
from exo.core.events import (
    AnyEvent,
    CommandRejected,
    DesireScaled,
    DesireSet,
    InstanceCreated,
    InstanceDeleted,
    NodeRegistered,
    RunnerStatusChanged,
    TaskCreated,
    TaskFinished,
    decode_event,
)
from exo.core.requests import GenerationParams
from exo.core.state import State
from exo.core.types import ModelCard, NodeInfo, Task
from exo.master.autoscale import ScalePolicy
from exo.master.decide import decide
from exo.master.service import Master
from exo.master.supervise import supervise
from exo.settings.services import ApiSettings, MasterSettings
from exo.tools.event_view import describe
from tests.conftest import eventually
from tests.support.as_master import fold
from tests.test_bus import view_with_a_node

MODEL = "org/m"
CARDS = {MODEL: ModelCard(model_id=MODEL, n_layers=4, storage_bytes=1000)}
POLICY = ScalePolicy(queue=4, window_s=30.0, idle_s=300.0)
NODES = [NodeRegistered(node=NodeInfo(node_id=f"n{n}", memory_available=10**9)) for n in range(1, 5)]


def placed(replicas: int = 1, min_replicas: int | None = 1, max_replicas: int | None = 3,
           keep_alive_s: float = -1.0) -> State:
    """PlaceInstance "p" at t=100 on four nodes, every instance ready."""
    command = PlaceInstance(command_id="p", model_id=MODEL, replicas=replicas, min_replicas=min_replicas,
                            max_replicas=max_replicas, keep_alive_s=keep_alive_s, at=100.0)
    events = decide(fold(NODES), command, builtin_cards=CARDS, ids=(f"p-{n}" for n in itertools.count()))
    assert [type(e) for e in events] == [InstanceCreated, DesireSet, *[InstanceCreated] * (replicas - 1)]
    return all_ready(fold(events, fold(NODES)))


def all_ready(state: State) -> State:
    return fold([RunnerStatusChanged(runner_id=r.runner_id, instance_id=r.instance_id, node_id=r.node_id,
                                     status="ready", at=0.0)
                 for r in state.runners.values() if r.status != "ready"], state)


def flood(state: State, count: int, at: float, instance_id: str = "") -> State:
    """`count` requests queued (pending, not started) on the desire's first instance."""
    target = instance_id or state.instances_of_desire("p")[0].instance_id
    start = len(state.tasks)
    return fold([TaskCreated(task=Task(task_id=f"t{start + n}", instance_id=target, model_id=MODEL, created_at=at))
                 for n in range(count)], state)


def tick(state: State, now: float, policy: ScalePolicy = POLICY) -> tuple[State, list[AnyEvent]]:
    """One round of the master's supervision at wall clock `now`, folded."""
    events = supervise(state, {}, now, builtin=CARDS, ids=(f"h{now:g}-{n}" for n in itertools.count()), scale=policy)
    return fold(events, state), events  # type: ignore[arg-type]


def scaled(to: int, came_from: int, reason: str, at: float) -> DesireScaled:
    return DesireScaled(desire_id="p", from_replicas=came_from, to_replicas=to, reason=reason, at=at)


def pressure_since(state: State) -> float:
    return state.desires["p"].pressure_since


def test_a_flood_raises_replicas_after_the_window_step_by_step_up_to_max_replicas_and_no_further():
    state = flood(placed(), 9, at=100.0)  # 9 pending on one ready replica: over 4
    state, events = tick(state, 110.0)
    assert events == [DesireSet(desire=msgspec.structs.replace(state.desires["p"]))] and pressure_since(state) == 110.0
    state, events = tick(state, 139.9)
    assert events == [] and state.desires["p"].replicas == 1  # the window is not over
    state, events = tick(state, 140.0)
    assert events == [scaled(2, 1, "9 pending, over 4 per replica for 30 s", 140.0)]
    assert (state.desires["p"].replicas, pressure_since(state), state.desires["p"].last_scaled_at) == (2, 0.0, 140.0)
    state, events = tick(state, 141.0)  # heal places the replica the desire is now short of
    assert [(type(e), e.instance.desire_id) for e in events if isinstance(e, InstanceCreated)] == [(InstanceCreated, "p")]
    assert len(events) == 1
    state, events = tick(state, 150.0)
    assert events == []  # the new replica still loads: no pressure counted, however long the queue
    state = all_ready(state)
    state, _ = tick(state, 160.0)  # 9 pending > 4 x 2 ready: a new window opens
    assert pressure_since(state) == 160.0
    state, events = tick(state, 190.0)
    assert events == [scaled(3, 2, "9 pending, over 4 per replica for 30 s", 190.0)]
    state, _ = tick(state, 191.0)
    state = all_ready(flood(state, 10, at=191.0))  # 19 pending > 4 x 3
    assert len(state.instances_of_desire("p")) == 3
    state, _ = tick(state, 200.0)
    for now in (230.0, 1000.0, 10_000.0):
        state, events = tick(state, now)
        assert events == [] and state.desires["p"].replicas == 3  # max_replicas: no further
    assert len(state.instances_of_desire("p")) == 3


def test_the_queue_counts_rows_a_request_of_n_choices_is_n():
    first = placed().instances_of_desire("p")[0].instance_id
    asked = [TaskCreated(task=Task(task_id=f"t{n}", instance_id=first, model_id=MODEL, created_at=100.0,
                                   params=params))
             for n, params in enumerate([GenerationParams(n=4), GenerationParams(n=4), GenerationParams(best_of=3)])]
    state, events = tick(fold(asked, placed()), 110.0)  # 3 requests, 11 rows: over 4
    assert [type(e) for e in events] == [DesireSet] and pressure_since(state) == 110.0
    state, events = tick(state, 140.0)
    assert events == [scaled(2, 1, "11 pending, over 4 per replica for 30 s", 140.0)]


def test_a_queue_that_drops_below_the_target_closes_the_window():
    state, _ = tick(flood(placed(), 9, at=100.0), 110.0)
    tasks = sorted(state.tasks)[:6]
    state = fold([TaskFinished(task_id=t, status="completed", at=120.0) for t in tasks], state)  # 3 left: not over 4
    state, events = tick(state, 125.0)
    assert [type(e) for e in events] == [DesireSet] and pressure_since(state) == 0.0
    state, events = tick(state, 1000.0)
    assert state.desires["p"].replicas == 1


def _busy_trio() -> tuple[State, list[str]]:
    """Three replicas (min 1) of which the second runs a long task since t=100; the first was last
    given a task at 150, the third at 120, both ended by 160: the desire was last used at 160."""
    state = placed(replicas=3, min_replicas=1, max_replicas=3)
    first, second, third = (i.instance_id for i in state.instances_of_desire("p"))
    state = fold([TaskCreated(task=Task(task_id="long", instance_id=second, model_id=MODEL, created_at=100.0)),
                  TaskCreated(task=Task(task_id="a", instance_id=first, model_id=MODEL, created_at=150.0)),
                  TaskCreated(task=Task(task_id="c", instance_id=third, model_id=MODEL, created_at=120.0)),
                  TaskFinished(task_id="c", status="completed", at=130.0),
                  TaskFinished(task_id="a", status="completed", at=160.0)], state)
    return state, [first, second, third]


def test_idleness_lowers_replicas_to_min_one_step_per_window_least_recently_used_first_never_one_with_work():
    state, (first, second, third) = _busy_trio()
    assert state.desires["p"].last_used_at == 160.0
    state, events = tick(state, 459.0)
    assert events == []  # 299 s idle
    state, events = tick(state, 460.0)
    assert events == [scaled(2, 3, "idle for 300 s", 460.0),
                      InstanceDeleted(instance_id=third, reason="scaled down: idle for 300 s")]
    state, events = tick(state, 489.0)
    assert events == []  # a window after the last step
    state, events = tick(state, 490.0)
    assert events == [scaled(1, 2, "idle for 330 s", 490.0),
                      InstanceDeleted(instance_id=first, reason="scaled down: idle for 330 s")]
    state, events = tick(state, 10_000.0)
    assert events == [] and [i.instance_id for i in state.instances_of_desire("p")] == [second]


def test_min_replicas_zero_never_unloads_an_instance_with_work_and_a_request_brings_one_back():
    state, (_, second, _) = _busy_trio()
    state = fold([DesireSet(desire=msgspec.structs.replace(state.desires["p"], min_replicas=0))], state)
    for now in (460.0, 490.0):
        state, _ = tick(state, now)
    state, events = tick(state, 10_000.0)
    assert events == [] and state.desires["p"].replicas == 1  # the last one runs a task: it stays
    state = fold([TaskFinished(task_id="long", status="completed", at=10_000.0)], state)
    state, events = tick(state, 10_300.0)
    assert events == [scaled(0, 1, "idle for 300 s", 10_300.0),
                      InstanceDeleted(instance_id=second, reason="scaled down: idle for 300 s")]
    asked = decide(state, GenerateText(command_id="late", model_id=MODEL, at=10_400.0), builtin_cards=CARDS,
                   ids=iter(()))
    assert [(type(e), e.task.instance_id) for e in asked if isinstance(e, TaskCreated)] == [(TaskCreated, "")]
    state, events = tick(fold(asked, state), 10_401.0)
    assert events == [scaled(1, 0, "a request waits and no replica runs", 10_401.0)]
    state, events = tick(state, 10_402.0)
    assert [type(e) for e in events] == [InstanceCreated]


def test_a_desire_placed_on_demand_never_scales_past_one_and_its_keep_alive_unloads_it_whole():
    state = fold(NODES)
    asked = decide(state, GenerateText(command_id="g", model_id=MODEL, at=100.0), builtin_cards=CARDS,
                   ids=(f"g-{n}" for n in itertools.count()), keep_alive_s=600.0)
    state = flood(all_ready(fold(asked, state)), 20, at=100.0, instance_id="g-2")
    desire = state.desires["g-0"]
    assert (desire.min_replicas, desire.max_replicas) == (0, 1)
    for now in (110.0, 200.0, 1000.0):
        state, events = tick(state, now)
        assert events == []  # at its max: not even a window opens
    assert state.desires["g-0"].replicas == 1



def test_an_on_demand_desire_kept_until_deleted_is_never_scaled_to_none():
    """keep_alive negative (Ollama's -1): the desire stays loaded idle, the autoscaler's floor too."""
    state = fold(NODES)
    asked = decide(state, GenerateText(command_id="g", model_id=MODEL, at=100.0, keep_alive_s=-1.0),
                   builtin_cards=CARDS, ids=(f"g-{n}" for n in itertools.count()), keep_alive_s=600.0)
    state = all_ready(fold(asked, state))
    assert (state.desires["g-0"].min_replicas, state.desires["g-0"].keep_alive_s) == (1, -1.0)
    state, events = tick(state, 100_000.0)
    assert events == [] and state.desires["g-0"].replicas == 1


def test_a_master_groups_model_is_not_scaled_by_the_shared_master():
    """Its queue is in its group's log: on the shared master it would look idle and lose replicas."""
    state, _ = _busy_trio()
    state = fold([TaskFinished(task_id="long", status="completed", at=160.0)], state)
    grouped = msgspec.structs.replace(state, groups={"alpha": ["org/*"]})
    assert tick(grouped, 10_000.0)[1] == []
    assert tick(state, 10_000.0)[1] != []  # the same State, ungrouped, scales down

def test_with_the_signal_off_nothing_scales():
    off = ScalePolicy(queue=0, window_s=0.0, idle_s=1.0)
    state = flood(placed(replicas=2, min_replicas=1, max_replicas=3), 50, at=100.0)
    for now in (110.0, 200.0, 1000.0):
        state, events = tick(state, now, off)
        assert events == []
    state = fold([TaskFinished(task_id=t, status="completed", at=1000.0) for t in list(state.tasks)], state)
    state, events = tick(state, 1e6, off)
    assert events == [] and state.desires["p"].replicas == 2 and len(state.instances_of_desire("p")) == 2


def test_a_new_master_keeps_the_windows_start_from_the_log():
    log: list[AnyEvent] = []
    state = flood(placed(), 9, at=100.0)
    state, events = tick(state, 110.0)
    log += events
    # The master fails over at 120: the next one folds the log (here: its State rebuilt from scratch).
    rebuilt = fold(log, flood(placed(), 9, at=100.0))
    assert pressure_since(rebuilt) == 110.0
    rebuilt, events = tick(rebuilt, 140.0)
    assert events == [scaled(2, 1, "9 pending, over 4 per replica for 30 s", 140.0)]


def test_a_desire_from_an_old_log_decodes_with_fixed_replicas_and_never_scales():
    old = (b'{"kind":"desire.set","term":1,"desire":{"desire_id":"p","model_id":"org/m","replicas":1,'
           b'"waiting":"","failures":0,"retry_at":0.0,"on_demand":false,"keep_alive_s":-1.0,"last_used_at":100.0}}')
    event = decode_event(old)
    assert isinstance(event, DesireSet)
    desire = event.desire
    assert (desire.min_replicas, desire.max_replicas, desire.pressure_since, desire.last_scaled_at) == (None, None, 0.0, 0.0)
    state = placed(min_replicas=None, max_replicas=None)
    state = flood(fold([event], state), 30, at=100.0)
    for now in (110.0, 200.0, 1e6):
        state, events = tick(state, now)
        assert events == []


def test_bounds_are_checked_where_a_placement_enters_and_by_the_master():
    state = fold(NODES)
    for low, high, param in ((2, 3, "min_replicas"), (-1, 3, "min_replicas"), (1, 65, "max_replicas"),
                             (None, 0, "max_replicas")):
        refused = decide(state, PlaceInstance(command_id="x", model_id=MODEL, replicas=1, min_replicas=low,
                                              max_replicas=high), builtin_cards=CARDS,
                         ids=(f"x-{n}" for n in itertools.count()))
        assert [type(e) for e in refused] == [CommandRejected] and refused[0].reason.startswith(param)
    one_given = decide(state, PlaceInstance(command_id="y", model_id=MODEL, replicas=2, max_replicas=4),
                       builtin_cards=CARDS, ids=(f"y-{n}" for n in itertools.count()))
    desire = next(e.desire for e in one_given if isinstance(e, DesireSet))
    assert (desire.min_replicas, desire.replicas, desire.max_replicas) == (2, 2, 4)
    state = fold(one_given, state)
    fewer = decide(state, DeleteInstance(command_id="z", instance_id=state.instances_of_desire("y")[0].instance_id),
                   builtin_cards=CARDS, ids=iter(()))
    lowered = next(e.desire for e in fewer if isinstance(e, DesireSet))  # a person's delete lowers the floor too
    assert (lowered.min_replicas, lowered.replicas, lowered.max_replicas) == (1, 1, 4)


async def test_place_instance_answers_400_naming_the_bound_that_is_wrong():
    async def post(body: dict[str, object]) -> ApiError:
        app = web.Application()
        app[CONTEXT_KEY] = ApiContext(nc=None, view=SimpleNamespace(state=State()), outcomes=None,  # type: ignore[arg-type]
                                      builtin_cards=CARDS, node_id="", data_dir=Path("."),
                                      settings=ApiSettings(max_body_bytes=10_000))
        loop = asyncio.get_running_loop()
        payload = StreamReader(BaseProtocol(loop), 2**16, loop=loop)
        payload.feed_data(json.dumps(body).encode())
        payload.feed_eof()
        request = make_mocked_request("POST", "/place_instance", app=app, payload=payload)
        with pytest.raises(ApiError) as refused:
            await instances_route.place_instance(request)
        return refused.value

    low = await post({"model_id": MODEL, "replicas": 2, "min_replicas": 3})
    assert (low.status, low.param) == (400, "min_replicas")
    assert str(low) == "min_replicas must be between 0 and replicas (2), not 3"
    high = await post({"model_id": MODEL, "replicas": 2, "max_replicas": 65})
    assert (high.status, high.param, str(high)) == (400, "max_replicas", "max_replicas must be between replicas (2) "
                                                                         "and 64, not 65")


def test_replay_shows_a_step_with_its_reason_even_to_zero():
    step = DesireScaled(desire_id="p", from_replicas=1, to_replicas=0, reason="idle for 300 s", at=5.0)
    assert describe(step) == "desire_id=p from_replicas=1 to_replicas=0 reason=idle for 300 s at=5.0"


async def test_the_master_appends_desire_scaled_with_its_reason_to_the_log(fresh_nats):
    nc = await connect([fresh_nats], name="autoscale")
    await provision(nc)
    view, answers = await view_with_a_node(nc, "autoscale")
    settings = MasterSettings(scale_queue=1, scale_window_s=0.0, scale_idle_s=3600.0)
    master = asyncio.create_task(Master(nc, view, CARDS, node_id="autoscale", settings=settings).run())
    try:
        await send_command(nc, PlaceInstance(command_id="as-place", model_id=MODEL, min_replicas=1, max_replicas=2))
        await eventually(lambda: "as-place" in answers, 10)
        placed_instance = answers["as-place"][0].instance
        shard = placed_instance.shards[0]
        await EventLog(nc).append(RunnerStatusChanged(runner_id=shard.runner_id, instance_id=placed_instance.instance_id,
                                                      node_id=shard.node_id, status="ready"), "as-ready")
        for n in range(3):  # no worker starts them: 3 pending on one ready replica, over 1
            await send_command(nc, GenerateText(command_id=f"as-{n}", model_id=MODEL))
        await eventually(lambda: view.state.desires["as-place"].replicas == 2, 8)
        js, last = nc.jetstream(), await EventLog(nc).last_sequence()
        logged = [json.loads((await js.get_msg("EXO_EVENTS", seq)).data) for seq in range(1, last + 1)]
        steps = [e for e in logged if e["kind"] == "desire.scaled"]
        assert [(s["desire_id"], s["from_replicas"], s["to_replicas"]) for s in steps] == [("as-place", 1, 2)]
        assert steps[0]["reason"].startswith("3 pending, over 1 per replica for ")
        await eventually(lambda: len(view.state.instances_of_desire("as-place")) == 2, 5)  # heal placed it
    finally:
        master.cancel()
        await asyncio.wait({master}, timeout=10)
        await view.stop()
        await nc.close()
