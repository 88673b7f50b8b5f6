"""Traces across processes (exo/telemetry): one chat on a cluster of a head node (master and API) and
worker nodes, each an `exo` process exporting spans over OTLP/HTTP to a small receiver in this test,
is one trace whose spans cover the seven hops of docs/architecture.md ("One chat request, hop by
hop"), each the child of the one before it, in the process that makes the hop; a client's
traceparent makes the trace the client's; a migrated request shows both runs; with tracing off
nothing is sent and no message carries a traceparent."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from exo.bus.connection import connect
from exo.telemetry.setup import traces_endpoint
from tests.support.cluster import NatsServer
from tests.support.exo_process import ExoProcess
from tests.support.healing import MODEL, SharedNatsCluster, chat_body, kill_9, state_of, stream_chat, wait_until
from tests.support.otlp_receiver import OtlpReceiver, Span
from tests.support.tiny_model import Dims, make_tiny_model
from tests.test_layering import importers_of

CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
EXPORT_FAST = {"OTEL_BSP_SCHEDULE_DELAY": "100"}  # ms between exports (5 s by default): the test waits less


@pytest.fixture(scope="module")
def receiver() -> Iterator[OtlpReceiver]:
    receiver = OtlpReceiver()
    yield receiver
    receiver.stop()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("model") / "tiny4", Dims(layers=4))


@dataclass
class Traced:
    cluster: SharedNatsCluster
    instance_id: str

    @property
    def head(self) -> ExoProcess:
        return self.cluster.head

    def worker(self) -> ExoProcess:
        """The worker node of the instance's runner."""
        (host,) = self.cluster.hosts(self.instance_id, self.head)
        return host


@pytest.fixture(scope="module")
def traced(tmp_path_factory, model_dir, receiver) -> Iterator[Traced]:
    """A head node (master and API) and two worker nodes, all tracing to `receiver`, MODEL placed on one worker."""
    cluster = SharedNatsCluster(tmp_path_factory.mktemp("traced"), model_dir, count=2,
                                env={"EXO_OTLP_ENDPOINT": receiver.url, **EXPORT_FAST})
    try:
        cluster.start()
        yield Traced(cluster, cluster.place(cluster.head)["instance_id"])
    finally:
        cluster.stop()


def chat(api_url: str, max_tokens: int = 8, headers: dict[str, str] | None = None) -> str:
    """A streamed chat to its end; its id (the task's)."""
    task_id = ""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "tell me about the sea"}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{api_url}/v1/chat/completions", json=body, headers=headers, timeout=120) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("data: {"):
                task_id = task_id or json.loads(line[6:])["id"].removeprefix("chatcmpl-")
    assert task_id
    return task_id


HOPS = {  # span -> its parent's name, hop by hop (docs/architecture.md)
    "exo.command.send": "exo.api.generation",  # (1) API -> EXO_COMMANDS
    "exo.master.decide": "exo.command.send",  # (2) EXO_COMMANDS -> master
    "exo.events.append": "exo.master.decide",  # (3) master -> EXO_EVENTS (task.created)
    "exo.events.deliver": "exo.events.append",  # (4) EXO_EVENTS -> every node's StateView
    "exo.worker.forward": "exo.events.deliver",  # (5) worker -> runner over its pipe
    "exo.runner.generate": "exo.worker.forward",
    "exo.runner.queue_wait": "exo.runner.generate",
    "exo.runner.prefill": "exo.runner.generate",
    "exo.runner.decode": "exo.runner.generate",
    "exo.tokens.publish": "exo.runner.generate",  # (6) runner -> exo.tokens.<id>
    "exo.tokens.receive": "exo.tokens.publish",  # (7) -> the API's TokenListener
}


def trace_of(receiver: OtlpReceiver, task_id: str, expected: set[str]) -> list[Span]:
    """Every span of the trace of the request `task_id`, once all of `expected` names are in."""
    def complete() -> list[Span] | None:
        roots = [s for s in receiver.named("exo.api.generation") if s.attributes.get("exo.task_id") == task_id]
        spans = receiver.of_trace(roots[0].trace_id) if roots else []
        return spans if expected <= {s.name for s in spans} else None
    return wait_until(complete, 30, 0.2, f"the spans of {task_id}'s trace")


def node_of(span: Span) -> str:
    """Which node made the span: its port in the node's name (host:port), "runner" for a runner."""
    return "runner" if span.resource["exo.process"] == "runner" else str(span.resource["service.instance.id"])


@pytest.mark.slow
def test_one_chat_is_one_trace_through_the_seven_hops_each_span_the_child_of_the_hop_before(traced, receiver):
    task_id = chat(traced.head.url)
    spans = trace_of(receiver, task_id, {"exo.api.generation", *HOPS})
    by_id = {s.span_id: s for s in spans}
    (root,) = [s for s in spans if s.name == "exo.api.generation"]
    assert root.parent_id == ""  # no client trace: the request's own
    for name, parent_name in HOPS.items():
        for span in (s for s in spans if s.name == name):
            assert by_id[span.parent_id].name == parent_name, (name, by_id.get(span.parent_id))
    head, worker = f":{traced.head.port}", traced.worker()
    made_on = {s.name: node_of(s) for s in spans if s.name != "exo.events.deliver"}
    assert {made_on[n] for n in ("exo.api.generation", "exo.command.send", "exo.master.decide", "exo.events.append",
                                 "exo.tokens.receive")} == {made_on["exo.api.generation"]}
    assert made_on["exo.api.generation"].endswith(head)
    assert made_on["exo.worker.forward"].endswith(f":{worker.port}")
    assert {made_on[n] for n in HOPS if n.startswith("exo.runner") or n == "exo.tokens.publish"} == {"runner"}
    # task.created reached the StateView of every node, each delivery a span: the worker's is the forward's parent
    delivered_on = sorted(node_of(s) for s in spans if s.name == "exo.events.deliver")
    assert len(delivered_on) == 3 and any(n.endswith(head) for n in delivered_on), delivered_on
    forward = next(s for s in spans if s.name == "exo.worker.forward")
    assert node_of(by_id[forward.parent_id]).endswith(f":{worker.port}")
    assert forward.attributes["exo.task_id"] == task_id and forward.attributes["exo.attempt"] == 0
    # one trace: every span naming this request is in it
    assert all(s.trace_id == root.trace_id for s in receiver.named("exo.worker.forward")
               if s.attributes.get("exo.task_id") == task_id)



@pytest.mark.slow
def test_a_clients_traceparent_makes_the_request_part_of_the_clients_trace(traced, receiver):
    task_id = chat(traced.head.url, headers={"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"})
    spans = trace_of(receiver, task_id, {"exo.api.generation", "exo.tokens.receive"})
    (root,) = [s for s in spans if s.name == "exo.api.generation"]
    assert (root.trace_id, root.parent_id) == (CLIENT_TRACE, CLIENT_SPAN)
    assert {s.trace_id for s in spans} == {CLIENT_TRACE} and set(HOPS) <= {s.name for s in spans}
    assert asyncio.run(traceparents_on_the_wire(traced.cluster.nats.url, task_id)) == {
        "command": True, "task.created": True, "chunk": True}


async def traceparents_on_the_wire(nats_url: str, task_id: str) -> dict[str, bool]:
    """Whether the request's command, its task.created event and its last token chunk, as stored, carry a traceparent."""
    nc = await connect([nats_url], name="test-tracing")
    try:
        js = nc.jetstream()
        stored = {"command": await js.get_last_msg("EXO_COMMANDS", "exo.commands.generate_text"),
                  "task.created": await js.get_last_msg("EXO_EVENTS", "exo.events.task.created"),
                  "chunk": await js.get_last_msg("EXO_TOKENS", f"exo.tokens.{task_id}")}
        assert task_id.encode() in stored["command"].data and task_id.encode() in stored["task.created"].data
        return {what: "traceparent" in (msg.headers or {}) for what, msg in stored.items()}
    finally:
        await nc.close()


@pytest.mark.slow
def test_a_migrated_request_shows_both_runs_in_its_trace(traced, receiver):
    """The worker running it is killed mid-stream: the master moves it to the other worker, whose
    forward (attempt 1) and runner spans join the same trace beside the first run's forward. The
    killed runner's own spans go with its machine: a span is exported when it ends."""
    victim = traced.worker()
    stream = stream_chat(traced.head.url, chat_body([{"role": "user", "content": "tell me about the sea"}], 1000))
    wait_until(lambda: stream.text_chunks() >= 10 or stream.done.is_set(), 60, 0.005, "the stream under way")
    assert not stream.done.is_set(), "the stream ended before its worker could be killed"
    # a span is exported after it ends (every 100 ms here): kill the worker once its forward is out, not before
    wait_until(lambda: any(s.attributes.get("exo.task_id") == stream.task_id for s in receiver.named("exo.worker.forward"))
               or stream.done.is_set(), 30, 0.005, "the first run's forward span exported")
    assert not stream.done.is_set(), "the stream ended before its worker could be killed"
    kill_9(victim)
    assert stream.done.wait(120) and stream.status == 200 and not stream.errors, stream.errors
    spans = trace_of(receiver, stream.task_id, {"exo.api.generation", "exo.runner.generate"})
    forwards = sorted((s for s in spans if s.name == "exo.worker.forward"), key=lambda s: s.attributes["exo.attempt"])
    assert [f.attributes["exo.attempt"] for f in forwards] == [0, 1]
    assert node_of(forwards[0]).endswith(f":{victim.port}") and not node_of(forwards[1]).endswith(f":{victim.port}")
    (second_run,) = [s for s in spans if s.name == "exo.runner.generate"]
    assert (second_run.parent_id, second_run.attributes["exo.attempt"]) == (forwards[1].span_id, 1)
    assert sorted(s.attributes["exo.attempt"] for s in spans if s.name == "exo.tokens.receive") == [0, 1]
    assert len(state_of(traced.head).tasks[stream.task_id].migrations) == 1


@pytest.mark.slow
def test_with_tracing_off_nothing_is_sent_and_no_message_carries_a_traceparent(tmp_path, model_dir):
    """OTEL_SDK_DISABLED=true wins over an endpoint that is set (the OpenTelemetry convention)."""
    receiver, nats = OtlpReceiver(), NatsServer(tmp_path / "nats")
    node = ExoProcess(tmp_path / "solo", {"EXO_NATS_URL": nats.url, "EXO_OTLP_ENDPOINT": receiver.url,
                                          "OTEL_SDK_DISABLED": "true", **EXPORT_FAST})
    try:
        node.start()
        added = httpx.post(f"{node.url}/models/add", json={"model_id": MODEL, "path": str(model_dir)}, timeout=60)
        assert added.status_code == 200, added.text
        placed = httpx.post(f"{node.url}/place_instance", json={"model_id": MODEL, "wait": 120}, timeout=150)
        assert placed.status_code == 200, placed.text
        task_id = chat(node.url, headers={"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"})
        assert asyncio.run(traceparents_on_the_wire(nats.url, task_id)) == {
            "command": False, "task.created": False, "chunk": False}
        time.sleep(1.0)  # ten export intervals
        assert (receiver.posts, receiver.spans) == (0, [])
    finally:
        node.interrupt()
        nats.stop()
        receiver.stop()


@pytest.mark.parametrize(("exo", "environ", "expected"), [
    ("", {}, ""),
    ("http://collector:4318", {}, "http://collector:4318/v1/traces"),
    ("http://collector:4318/", {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://other:4318"}, "http://collector:4318/v1/traces"),
    ("", {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://other:4318"}, "http://other:4318/v1/traces"),
    ("", {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://other:4318", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://t/x"},
     "http://t/x"),
    ("http://collector:4318", {"OTEL_SDK_DISABLED": "TRUE"}, ""),
    ("", {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://other:4318", "OTEL_TRACES_EXPORTER": "none"}, ""),
])
def test_tracing_is_off_unless_an_endpoint_is_set_as_opentelemetry_s_variables_say(exo, environ, expected):
    assert traces_endpoint(exo, environ) == expected


def test_only_the_telemetry_package_imports_opentelemetry():
    assert importers_of("opentelemetry", outside="telemetry") == {}
