"""The master's lifecycle lines (exo/master/lifecycle_log.py): the deciders' own events folded one by
one, as the master's view folds the log, each logged with the State before it. Pure: a fake clock."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterable

import pytest
from msgspec.structs import replace

from exo.core.apply import apply
from exo.core.commands import GenerateText, PlaceInstance
from exo.core.events import AnyEvent, DesireScaled, Event, InstanceCreated, NodeHeartbeat, NodeRegistered, RunnerStatusChanged
from exo.core.ids import ModelId, NodeId
from exo.core.state import State
from exo.core.types import Instance, ModelCard, NodeInfo
from exo.master.decide import decide
from exo.master.heal import replace_missing
from exo.master.lifecycle_log import LifecycleLog
from exo.master.supervise import suspect_marks, time_out_node
from tests.support.as_master import stamped, with_leader

GB = 1_000_000_000
M, N = ModelId("org/m"), ModelId("org/n")
CARDS = {m: ModelCard(model_id=m, n_layers=4, storage_bytes=GB) for m in (M, N)}
STUDIO = NodeInfo(node_id=NodeId("a" * 32), name="studio:52416", memory_available=10 * GB)
MINI = NodeInfo(node_id=NodeId("b" * 32), name="mini", memory_available=10 * GB)


class Told:
    """A master's view and its LifecycleLog: `fold` applies events as the log delivers them."""

    def __init__(self, state: State, leading: bool = True) -> None:
        self.state = state
        self.now = 100.0
        self.log = LifecycleLog(state, lambda: leading, clock=lambda: self.now)

    def fold(self, events: Iterable[Event]) -> State:
        for event in events:
            event = stamped(self.state, event)  # type: ignore[arg-type]  # every Event is an AnyEvent
            self.state = apply(self.state, event, self.state.last_seq + 1)
            self.log.on_event(self.state.last_seq, event, self.state)
        return self.state


def two_nodes() -> State:
    return with_leader(State(nodes={n.node_id: n for n in (STUDIO, MINI)}))


def ids(prefix: str):
    return (f"{prefix}-{n}" for n in itertools.count())


def runner_status(instance: Instance, status: str, error: str = "", failures: int = 0) -> list[AnyEvent]:
    return [RunnerStatusChanged(runner_id=s.runner_id, instance_id=instance.instance_id, node_id=s.node_id,
                                status=status, error=error, failures=failures) for s in instance.shards]  # type: ignore[arg-type]


def placed(events: list[Event]) -> Instance:
    return next(e.instance for e in events if isinstance(e, InstanceCreated))


def test_nodes_join_once_and_leave_by_name_not_id(caplog: pytest.LogCaptureFixture):
    told = Told(with_leader())
    with caplog.at_level(logging.INFO, logger="exo.master.service"):
        told.fold([NodeRegistered(node=STUDIO), NodeHeartbeat(node=STUDIO), NodeHeartbeat(node=MINI)])
        told.fold(time_out_node(told.state, MINI.node_id, 30.0))
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        ("INFO", "master: node studio:52416 joined"),
        ("INFO", "master: node mini joined"),
        ("WARNING", "master: node mini gone: timed out: no heartbeat for 30 s"),
    ]
    assert [r.node_id for r in caplog.records] == [STUDIO.node_id, MINI.node_id, MINI.node_id]  # type: ignore[attr-defined]


def test_an_instance_placed_by_request_loads_is_ready_fails_and_is_replaced(caplog: pytest.LogCaptureFixture):
    told = Told(two_nodes())
    with caplog.at_level(logging.INFO, logger="exo.master.service"):
        events = decide(told.state, PlaceInstance(command_id="p", model_id=M), builtin_cards=CARDS, ids=ids("p"))
        first = placed(events)
        told.fold(events)
        told.fold(runner_status(first, "loading"))
        told.now = 112.5
        told.fold(runner_status(first, "ready"))
        told.fold(runner_status(first, "failed", "out of memory", failures=3))
        node = first.shards[0].node_id
        told.fold(time_out_node(told.state, node, 30.0))
        again = replace_missing(told.state, CARDS, ids("r"), 200.0)
        told.fold(again)
    label = "studio:52416" if node == STUDIO.node_id else "mini"
    other = "mini" if node == STUDIO.node_id else "studio:52416"
    gone = "timed out: no heartbeat for 30 s"
    assert caplog.messages == [
        f"master: placed {M} on {label}: by request (instance {first.instance_id})",
        f"master: {M} loading on {label} (instance {first.instance_id})",
        f"master: {M} ready on {label} in 12.5 s from placement (instance {first.instance_id})",
        f"master: {M} failed on {label}: out of memory (instance {first.instance_id}, failure 3)",
        f"master: unloaded {M} from {label}: node {label} {gone} (instance {first.instance_id})",
        f"master: node {label} gone: {gone}",
        f"master: placed {M} on {other}: replacing instance {first.instance_id} (node {label} {gone}) "
        f"(instance {placed(again).instance_id})",
    ]
    fields = caplog.records[0].__dict__
    assert (fields["model"], fields["instance_id"]) == (M, first.instance_id)  # JSON lines carry them


def test_the_ready_line_says_the_slowest_ranks_warm_up_and_each_readiness_its_own(caplog: pytest.LogCaptureFixture):
    reachable = {n.node_id: replace(n, addresses=[f"10.0.0.{i}"], ring_port_first=5000, ring_port_count=4)
                 for i, n in enumerate((STUDIO, MINI), 1)}
    told = Told(with_leader(State(nodes=reachable)))
    events = decide(told.state, PlaceInstance(command_id="p", model_id=M, min_nodes=2), builtin_cards=CARDS,
                    ids=ids("p"))
    instance = placed(events)
    told.fold(events)
    first, second = (replace(e, warm_up_s=s) for e, s in zip(runner_status(instance, "ready"), (3.5, 0.25), strict=True))
    with caplog.at_level(logging.INFO, logger="exo.master.service"):
        told.now = 110.0
        told.fold([first, second])  # the line comes once both are ready: with the slower one's warm-up
        told.fold(runner_status(instance, "failed", "killed", failures=1)[:1])
        told.fold([replace(first, warm_up_s=0.04, failures=1)])  # restarted with the kernels cached: its own time
        told.fold([replace(first, warm_up_s=9.0)])  # already ready: no line, and not kept for the next one
        told.fold(runner_status(instance, "failed", "killed", failures=1)[1:])
        told.fold([replace(second, warm_up_s=0.5, failures=1)])
    labels = ["studio:52416" if s.node_id == STUDIO.node_id else "mini" for s in instance.shards]
    ready = f"master: {M} ready on {', '.join(labels)} in 10.0 s from placement (instance {instance.instance_id}"
    assert caplog.messages == [
        f"{ready}, warm-up 3.50 s)",
        f"master: {M} failed on {labels[0]}: killed (instance {instance.instance_id}, failure 1)",
        f"{ready}, warm-up 0.04 s)",
        f"master: {M} failed on {labels[1]}: killed (instance {instance.instance_id}, failure 1)",
        f"{ready}, warm-up 0.50 s)",
    ]


def test_a_request_places_on_demand_and_moves_when_its_instance_goes(caplog: pytest.LogCaptureFixture):
    told = Told(two_nodes())
    with caplog.at_level(logging.INFO, logger="exo.master.service"):
        events = decide(told.state, GenerateText(command_id="g", model_id=N, at=50.0), builtin_cards=CARDS,
                        ids=ids("g"))
        told.fold(events)
        instance = placed(events)
        node = instance.shards[0].node_id
        told.fold(time_out_node(told.state, node, 30.0))
    label = "studio:52416" if node == STUDIO.node_id else "mini"
    assert caplog.messages == [
        f"master: placed {N} on {label}: on demand (instance {instance.instance_id})",
        f"master: moved task g of {N} from {label} (instance {instance.instance_id}) to the queue (no instance yet): "
        f"instance {instance.instance_id}: node {label} timed out: no heartbeat for 30 s",
        f"master: unloaded {N} from {label}: node {label} timed out: no heartbeat for 30 s (instance "
        f"{instance.instance_id})",
        f"master: node {label} gone: timed out: no heartbeat for 30 s",
    ]


def test_a_scaled_desire_says_why_its_next_instance_is_placed(caplog: pytest.LogCaptureFixture):
    told = Told(two_nodes())
    told.fold(decide(told.state, PlaceInstance(command_id="p", model_id=M, min_replicas=1, max_replicas=2),
                     builtin_cards=CARDS, ids=ids("p")))
    with caplog.at_level(logging.INFO, logger="exo.master.service"):
        told.fold([DesireScaled(desire_id="p", from_replicas=1, to_replicas=2, reason="queue above 4 for 30 s")])
        second = replace_missing(told.state, CARDS, ids("s"), 200.0)
        told.fold(second)
    instance = placed(second)
    label = "studio:52416" if instance.shards[0].node_id == STUDIO.node_id else "mini"
    assert caplog.messages == [
        f"master: scaled {M} from 1 to 2 replica(s): queue above 4 for 30 s",
        f"master: placed {M} on {label}: scaled from 1 to 2 replicas (instance {instance.instance_id})",
    ]


def test_only_the_leading_master_tells(caplog: pytest.LogCaptureFixture):
    told = Told(with_leader(), leading=False)
    with caplog.at_level(logging.INFO, logger="exo.master.service"):
        told.fold([NodeRegistered(node=STUDIO)])
    assert caplog.messages == []


def test_suspect_nodes_and_their_return_are_told_once(caplog: pytest.LogCaptureFixture):
    told = Told(two_nodes())
    with caplog.at_level(logging.INFO, logger="exo.master.service"):
        for now, silent in enumerate(([], [MINI.node_id], [MINI.node_id], [], [])):
            marks = suspect_marks(told.state, silent, float(now + 1), 5.0)
            told.fold([*marks, *marks])  # the second of each is skipped: no line of its own
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        ("WARNING", "master: node mini suspect: no pulse for 5 s"),
        ("INFO", "master: node mini back"),
    ]
