"""GET /metrics/history's samples (exo/api/metrics_history.py), without a cluster: what two readings
make (requests and tokens per model as rates, queue per instance, TTFT quantiles of the interval's
observations, memory by node name), the quantile as Prometheus computes it, a bounded history, and
the route served in process (the sampler runs with the app; `after`; the key as /metrics asks it).
Against a real node and in Chromium: tests/test_dashboard_history.py."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
from aiohttp.test_utils import TestClient, TestServer

from exo.api.app import build_app
from exo.api.context import ApiContext
from exo.api.metrics_history import HISTORY_KEY, MetricsHistory, Reading, quantile, sample_between
from exo.core.ids import InstanceId, ModelId, NodeId, TaskId
from exo.core.state import State
from exo.core.types import Instance, NodeInfo, Task, TaskStatus
from exo.settings.services import ApiSettings

INF = math.inf
GB = 1_000_000_000


def task(task_id: str, model: str, status: TaskStatus, tokens: int = 0, instance: str = "i-a") -> Task:
    return Task(task_id=TaskId(task_id), instance_id=InstanceId(instance), model_id=ModelId(model), status=status,
                completion_tokens=tokens)


def state(*tasks: Task, nodes: tuple[NodeInfo, ...] = ()) -> State:
    instances = {InstanceId("i-a"): Instance(instance_id=InstanceId("i-a"), model_id=ModelId("org/a")),
                 InstanceId("i-c"): Instance(instance_id=InstanceId("i-c"), model_id=ModelId("org/c"))}
    return State(tasks={t.task_id: t for t in tasks}, instances=instances, nodes={n.node_id: n for n in nodes})


def node(node_id: str, name: str, total: int, available: int) -> NodeInfo:
    return NodeInfo(node_id=NodeId(node_id), name=name, memory_total=total, memory_available=available)


def test_quantiles_interpolate_inside_the_bucket_as_prometheus_does():
    buckets = ((0.1, 2.0), (0.5, 4.0), (INF, 4.0))
    assert quantile(0.5, buckets) == pytest.approx(0.1)  # rank 2: the top of the first bucket
    assert quantile(0.99, buckets) == pytest.approx(0.1 + 0.4 * 1.96 / 2)
    assert quantile(0.25, buckets) == pytest.approx(0.05)
    assert quantile(0.99, ((0.1, 1.0), (1.0, 1.0), (INF, 3.0))) == 1.0  # past the last bound: that bound
    assert quantile(0.5, ((0.1, 0.0), (INF, 0.0))) is None
    assert quantile(0.5, ()) is None


def test_a_sample_is_what_changed_between_two_readings():
    before = Reading(at=100.0, wall=1_000.0, state=state(
        task("old-done", "org/a", "completed", 7), task("old-open", "org/a", "running")),
        ttft=((0.1, 3.0), (0.5, 3.0), (INF, 3.0)))
    after = Reading(at=104.0, wall=1_004.0, state=state(
        task("old-done", "org/a", "completed", 7),  # ended before: not counted again
        task("old-open", "org/a", "completed", 20),  # ended in the interval: its tokens count, not its request
        task("new-done", "org/a", "completed", 12),  # asked and ended in it: both
        task("new-open", "org/a", "pending"),
        task("new-b", "org/b", "cancelled", 3, instance="i-gone"),  # a model without an instance now
        nodes=(node("n1", "mac", 64 * GB, 40 * GB), node("n2", "box", 16 * GB, 16 * GB),
               node("n3", "box", 8 * GB, 2 * GB))),
        ttft=((0.1, 4.0), (0.5, 5.0), (INF, 5.0)))

    sample = sample_between(before, after)

    assert sample.t == 1_004.0 and sample.interval_s == 4.0
    assert {m: (r.requests, r.completion_tokens, r.requests_per_s, r.tokens_per_s) for m, r in sample.models.items()} == {
        "org/a": (2, 32, 0.5, 8.0), "org/b": (1, 3, 0.25, 0.75), "org/c": (0, 0, 0.0, 0.0)}
    assert {i: (q.model_id, q.depth) for i, q in sample.queues.items()} == {"i-a": ("org/a", 1), "i-c": ("org/c", 0)}
    # Two first tokens in the interval, one under 0.1 s and one under 0.5 s: the window's quantiles.
    assert sample.ttft.count == 2
    assert sample.ttft.p50_s == pytest.approx(0.1)
    assert sample.ttft.p99_s == pytest.approx(0.1 + 0.4 * 0.98)
    assert {n: (m.used_bytes, m.total_bytes) for n, m in sample.memory.items()} == {
        "mac": (24 * GB, 64 * GB), "box (n2)": (0, 16 * GB), "box (n3)": (6 * GB, 8 * GB)}


def test_an_interval_without_first_tokens_has_no_ttft():
    quiet = Reading(at=0.0, wall=0.0, state=State(), ttft=((0.1, 3.0), (INF, 3.0)))
    sample = sample_between(quiet, Reading(at=10.0, wall=10.0, state=State(), ttft=((0.1, 3.0), (INF, 3.0))))
    assert (sample.ttft.count, sample.ttft.p50_s, sample.ttft.p99_s) == (0, None, None)
    assert sample.models == {} and sample.queues == {} and sample.memory == {}


def test_the_history_keeps_its_last_samples_only():
    history = MetricsHistory(interval_s=10.0, kept=3)
    readings = [Reading(at=float(i), wall=float(i), state=State(), ttft=()) for i in range(6)]
    for before, after in zip(readings, readings[1:], strict=False):
        history.samples.append(sample_between(before, after))
    assert [s.t for s in history.since(-INF).samples] == [3.0, 4.0, 5.0]
    assert [s.t for s in history.since(4.0).samples] == [5.0]


# -- the route, served in process -------------------------------------------------------------

KEY = "history-key"


def app_client(view: SimpleNamespace, interval_s: float) -> TestClient:
    # No NATS: the sampler reads only State and this app's counters.
    ctx = ApiContext(nc=None, view=view, outcomes=None,  # type: ignore[arg-type]
                     builtin_cards={}, node_id="", data_dir=Path("."),
                     settings=ApiSettings(api_keys=(KEY,), metrics_history_s=interval_s))
    return TestClient(TestServer(build_app(ctx)))


async def test_the_route_serves_the_samples_the_app_takes_newer_than_after_to_the_key_only():
    view = SimpleNamespace(state=state())
    auth = {"Authorization": f"Bearer {KEY}"}
    async with app_client(view, interval_s=0.05) as client:
        history = client.server.app[HISTORY_KEY]
        view.state = state(task("t1", "org/a", "completed", 5), task("t2", "org/a", "running"))
        for _ in range(200):  # the sampler runs with the app: wait for a sample that saw the change
            if len(history.samples) >= 2 and any(s.models["org/a"].requests for s in history.samples):
                break
            await asyncio.sleep(0.02)
        answer = await client.get("/metrics/history", headers=auth)
        assert answer.status == 200 and answer.content_type == "application/json"
        body = await answer.json()
        assert body["interval_s"] == 0.05 and body["kept"] == 360
        samples = body["samples"]
        assert sum(s["models"]["org/a"]["requests"] for s in samples) == 2
        assert sum(s["models"]["org/a"]["completion_tokens"] for s in samples) == 5
        assert all(s["models"]["org/a"]["requests_per_s"] == s["models"]["org/a"]["requests"] / s["interval_s"]
                   for s in samples)
        assert samples[-1]["queues"] == {"i-a": {"model_id": "org/a", "depth": 1}, "i-c": {"model_id": "org/c",
                                                                                            "depth": 0}}
        assert [s["t"] for s in samples] == sorted(s["t"] for s in samples)
        newer = await (await client.get("/metrics/history", params={"after": repr(samples[-2]["t"])},
                                        headers=auth)).json()
        assert newer["samples"][0] == samples[-1]  # only what came after: the page appends it
        assert (await client.get("/metrics/history")).status == 401  # as /metrics
        assert (await client.get("/metrics")).status == 401
        bad = await client.get("/metrics/history", params={"after": "soon"}, headers=auth)
        assert bad.status == 400 and (await bad.json())["error"]["param"] == "after"
        for nonsense in ("nan", "inf"):
            assert (await client.get("/metrics/history", params={"after": nonsense}, headers=auth)).status == 400
