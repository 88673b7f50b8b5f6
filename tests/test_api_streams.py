"""Streams and the queue, against `exo` as a process: resuming a dropped stream from JetStream,
cancelling, admission (429 + Retry-After), the event log as SSE, and /metrics."""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.support.cluster import wait_until
from tests.support.e2e import Reference, exo_serving, place
from tests.support.tiny_model import TINY_MODEL_ID, make_tiny_model

pytestmark = pytest.mark.slow

MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Tell me about the sea."}]
LONG = 1500  # tokens: about a second and a half on the tiny model, long enough to drop a stream mid-way


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("model") / "tiny")


@pytest.fixture(scope="module")
def node(tmp_path_factory, model_dir):
    # A quiet log: tests here read exact runs of events, which heartbeats would interleave.
    # A short resume grace: the generations that must outlive it need not be long.
    quiet = {"EXO_HEARTBEAT_S": "3600", "EXO_NODE_TIMEOUT_S": "7200", "EXO_RESUME_GRACE_S": "1"}
    with exo_serving(tmp_path_factory.mktemp("node"), {TINY_MODEL_ID: model_dir}, quiet) as exo:
        yield exo


@pytest.fixture(scope="module")
def tiny(http, model_dir) -> Reference:
    place(http, TINY_MODEL_ID)
    return Reference(model_dir)


@pytest.fixture(scope="module")
def expected_long(tiny) -> str:
    return tiny.chat(MESSAGES, LONG)


def sse_events(lines: Iterator[str]) -> Iterator[dict]:
    """Server-sent events as {"id", "event", "data"} dicts (data decoded when it is JSON)."""
    event: dict = {}
    for line in lines:
        if not line:
            if "data" in event:
                yield event
            event = {}
        elif not line.startswith(":"):
            field, _, value = line.partition(": ")
            event[field] = json.loads(value) if field == "data" and value.startswith("{") else value


def content_of(events: list[dict]) -> str:
    return "".join(e["data"]["choices"][0]["delta"].get("content") or ""
                   for e in events if isinstance(e["data"], dict) and e["data"].get("choices"))


def task_of(http: httpx.Client, task_id: str) -> dict:
    return http.get("/state").json()["tasks"].get(task_id, {})


def wait_for_status(http: httpx.Client, task_id: str, *statuses: str, timeout: float = 30) -> dict:
    def task_in_status() -> dict | None:
        task = task_of(http, task_id)
        return task if task.get("status") in statuses else None

    return wait_until(task_in_status, timeout, 0.05, what=f"task {task_id} {' or '.join(statuses)}")


def open_stream(http: httpx.Client, take: int, **body) -> tuple[str, list[dict]]:
    """Start a chat stream, read `take` events, drop the connection; returns (command id, events)."""
    body = {"model": TINY_MODEL_ID, "messages": MESSAGES, "temperature": 0, "stream": True} | body
    events = []
    with http.stream("POST", "/v1/chat/completions", json=body) as response:
        for event in sse_events(response.iter_lines()):
            events.append(event)
            if len(events) == take:
                break
    return events[0]["data"]["id"].removeprefix("chatcmpl-"), events


def test_every_stream_event_carries_an_id(http, tiny):
    _, events = open_stream(http, 1000, max_tokens=24, stream_options={"include_usage": True})
    command_id = events[0]["data"]["id"].removeprefix("chatcmpl-")
    assert all(re.fullmatch(rf"{command_id}:-?\d+", e["id"]) for e in events if e["data"] != "[DONE]")
    indexes = [int(e["id"].rsplit(":", 1)[1]) for e in events if "id" in e]
    assert indexes == sorted(indexes) and indexes[0] == -1


def test_a_dropped_stream_resumes_with_the_rest_of_the_same_generation(http, tiny, expected_long):
    command_id, first = open_stream(http, 4, max_tokens=LONG)
    assert task_of(http, command_id)["status"] in ("pending", "running")  # dropped mid-generation (running: after 1 s)
    after = first[-1]["id"].rsplit(":", 1)[1]
    with http.stream("GET", f"/v1/chat/completions/chatcmpl-{command_id}/stream", params={"after": after}) as response:
        assert response.status_code == 200
        second = []
        for event in sse_events(response.iter_lines()):  # drop this one too, and resume with Last-Event-ID
            second.append(event)
            if len(second) == 3:
                break
    headers = {"Last-Event-ID": second[-1]["id"]}
    with http.stream("POST", "/v1/chat/completions", headers=headers, json={}) as response:
        third = list(sse_events(response.iter_lines()))
    assert content_of(first) + content_of(second) + content_of(third) == expected_long
    assert third[-1]["data"] == "[DONE]" and third[-2]["data"]["choices"][0]["finish_reason"] == "length"
    task = wait_for_status(http, command_id, "completed")
    assert task["status"] == "completed" and task["completion_tokens"] == LONG  # generated once, never cancelled


VERY_LONG = 4_000  # tokens: ~5 s here (more with a long context), well past the node's resume grace (1 s) after the drop


def _read_in_thread(url: str, command_id: str, after: str, into: list[dict]) -> threading.Thread:
    """A client resuming the generation after chunk `after` and reading it to its end, in a thread."""

    def read() -> None:
        with httpx.Client(base_url=url, timeout=120) as other:
            with other.stream("GET", f"/v1/chat/completions/chatcmpl-{command_id}/stream",
                              params={"after": after}) as response:
                into.extend(sse_events(response.iter_lines()))

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    return thread


def _read_to_the_end(http: httpx.Client, command_id: str, reader: threading.Thread, events: list[dict]) -> None:
    reader.join(240)
    assert events and events[-1]["data"] == "[DONE]", events[-3:]
    assert events[-2]["data"]["choices"][0]["finish_reason"] == "length"  # never "cancelled" under its reader
    task = wait_for_status(http, command_id, "completed", "cancelled")
    assert task["status"] == "completed" and task["completion_tokens"] == VERY_LONG


def test_a_reader_keeps_a_generation_that_another_resumed_reader_left(http, tiny):
    """Client A drops; B and C resume; B drops: C, still reading, keeps its generation (B's grace
    timer used to cancel it when the grace ran out, one pending cancel per generation and no count of readers)."""
    command_id, first = open_stream(http, 3, max_tokens=VERY_LONG)
    with http.stream("GET", f"/v1/chat/completions/chatcmpl-{command_id}/stream") as b:
        b_stream = sse_events(b.iter_lines())  # kept open: leaving a `for` over it would close B at once
        assert next(b_stream) and next(b_stream)
        c_events: list[dict] = []
        c = _read_in_thread(str(http.base_url), command_id, first[-1]["id"].rsplit(":", 1)[1], c_events)
        wait_until(lambda: c_events, 30, what="C reading")
    _read_to_the_end(http, command_id, c, c_events)  # B left above, with C still reading


def test_a_stream_resumed_on_another_api_node_keeps_its_generation(http, node, tiny, tmp_path):
    """The client drops on one API node and comes back on another: the first node's grace timer
    must not cancel what the second one is streaming (it asks on exo.readers.<id> first)."""
    from tests.support.cluster import start_node
    from tests.support.e2e import nats_url_of

    other = start_node(tmp_path, "api-b", nats_url_of(node), "--no-master", "--no-worker")
    try:
        command_id, first = open_stream(http, 3, max_tokens=VERY_LONG)
        events: list[dict] = []
        reader = _read_in_thread(other.url, command_id, first[-1]["id"].rsplit(":", 1)[1], events)
        _read_to_the_end(http, command_id, reader, events)
    finally:
        other.interrupt()


def test_a_finished_generation_replays_whole_from_the_start(http, client, tiny):
    reply = client.chat.completions.create(model=TINY_MODEL_ID, messages=MESSAGES, temperature=0, max_tokens=24)
    with http.stream("GET", f"/v1/chat/completions/{reply.id}/stream", params={"include_usage": "true"}) as response:
        events = list(sse_events(response.iter_lines()))
    assert content_of(events) == reply.choices[0].message.content == tiny.chat(MESSAGES, 24)
    assert events[-2]["data"]["usage"]["completion_tokens"] == 24


def test_resuming_something_unknown_is_a_clear_error(http, tiny):
    assert http.get("/v1/chat/completions/chatcmpl-nope/stream").status_code == 404
    assert http.get("/v1/chat/completions/x/stream", params={"after": "many"}).status_code == 400
    bad = http.post("/v1/chat/completions", headers={"Last-Event-ID": "garbage"}, json={})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "Last-Event-ID"


def test_cancel_stops_a_generation_and_frees_the_runner(http, client, tiny):
    body = {"model": TINY_MODEL_ID, "messages": MESSAGES, "max_tokens": 30_000, "stream": True}  # the card's context: 32768
    with http.stream("POST", "/v1/chat/completions", json=body) as response:
        events = sse_events(response.iter_lines())
        command_id = next(events)["data"]["id"].removeprefix("chatcmpl-")
        next(events)
        cancelled = http.post(f"/v1/cancel/chatcmpl-{command_id}")
        rest = list(events)
    assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
    assert rest[-1]["data"] == "[DONE]" and rest[-2]["data"]["error"]["code"] == "cancelled"
    task = task_of(http, command_id)
    assert task["status"] == "cancelled" and 0 < task["completion_tokens"] < 30_000
    reply = client.chat.completions.create(model=TINY_MODEL_ID, messages=MESSAGES, temperature=0, max_tokens=24)
    assert reply.choices[0].message.content == tiny.chat(MESSAGES, 24)
    again = http.post(f"/v1/cancel/{command_id}")  # already over: says how it ended
    assert again.status_code == 200 and again.json()["status"] == "cancelled"
    assert http.post("/v1/cancel/no-such-task").status_code == 404


def test_a_full_queue_answers_429_with_retry_after(http, client, model_dir, tiny):
    assert http.post("/models/add", json={"model_id": "local/queue", "path": str(model_dir)}).status_code == 200
    place(http, "local/queue", max_queue=1)
    body = {"model": "local/queue", "messages": MESSAGES, "max_tokens": 30_000, "stream": True}  # the card's context: 32768
    with http.stream("POST", "/v1/chat/completions", json=body) as response:
        command_id = next(sse_events(response.iter_lines()))["data"]["id"].removeprefix("chatcmpl-")
        refused = http.post("/v1/chat/completions", json={**body, "stream": False})
        with pytest.raises(openai.RateLimitError):
            client.chat.completions.create(model="local/queue", messages=MESSAGES, max_tokens=4)
        assert http.post(f"/v1/cancel/{command_id}").json()["status"] == "cancelled"
    assert refused.status_code == 429 and refused.headers["Retry-After"] == "1"
    assert refused.json()["error"]["code"] == "overloaded"
    reply = client.chat.completions.create(model="local/queue", messages=MESSAGES, temperature=0, max_tokens=8)
    assert reply.choices[0].message.content == tiny.chat(MESSAGES, 8)  # admitted again once the queue drained


def test_events_replay_the_log_from_since_and_follow_it_live(http, client, tiny):
    with http.stream("GET", "/events", params={"since": 0}) as response:
        history = [e for _, e in zip(range(3), sse_events(response.iter_lines()))]
    assert [int(e["id"]) for e in history] == [1, 2, 3]
    assert all(e["data"]["kind"] == e["event"] for e in history)
    with http.stream("GET", "/events", headers={"Last-Event-ID": "2"}) as response:
        assert next(sse_events(response.iter_lines()))["id"] == "3"

    last_seq = http.get("/state").json()["last_seq"]
    reply: list = []
    ask = threading.Thread(target=lambda: reply.append(client.chat.completions.create(
        model=TINY_MODEL_ID, messages=MESSAGES, temperature=0, max_tokens=4)))
    with http.stream("GET", "/events") as response:
        ask.start()
        live, created = [], set()
        for event in sse_events(response.iter_lines()):
            live.append(event)
            if event["event"] == "task.created":
                created.add(event["data"]["task"]["task_id"])
            # The end of a task created here: an earlier test's cancelled task may end in between.
            if event["event"] == "task.finished" and event["data"]["task_id"] in created:
                break
    ask.join()
    task_id = reply[0].id.removeprefix("chatcmpl-")
    # every event from the next sequence on, none skipped (a download's progress or a heartbeat may come between)
    assert [int(e["id"]) for e in live] == list(range(last_seq + 1, last_seq + 1 + len(live)))
    ours = [e for e in live if e["data"].get("task_id", e["data"].get("task", {}).get("task_id")) == task_id]
    # Four tokens take well under a second: the log hears no task.started (exo/worker/runners.py).
    assert [e["event"] for e in ours] == ["task.created", "task.finished"], [e["event"] for e in live]
    assert http.get("/events", params={"since": "soon"}).status_code == 400


def metric_values(http: httpx.Client) -> dict[str, float]:
    response = http.get("/metrics")
    assert response.status_code == 200 and response.headers["Content-Type"].startswith("text/plain; version=0.0.4")
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in response.text.splitlines() if line and not line.startswith("#")}


def test_metrics_count_requests_latency_tokens_queue_and_the_log(http, client, tiny):
    before = metric_values(http)
    chat = 'exo_http_requests_total{method="POST",route="/v1/chat/completions",status="200"}'
    client.chat.completions.create(model=TINY_MODEL_ID, messages=MESSAGES, temperature=0, max_tokens=10)
    list(client.chat.completions.create(model=TINY_MODEL_ID, messages=MESSAGES, temperature=0, max_tokens=10, stream=True))
    assert http.post("/v1/chat/completions", json={"model": "nobody/nothing", "messages": MESSAGES}).status_code == 404
    after = metric_values(http)
    prompt = tiny.prompt_tokens(tiny.chat_prompt(MESSAGES))
    assert after[chat] - before.get(chat, 0) == 2
    assert after['exo_http_requests_total{method="POST",route="/v1/chat/completions",status="404"}'] >= 1
    assert after["exo_time_to_first_token_seconds_count"] - before["exo_time_to_first_token_seconds_count"] == 2
    assert after["exo_completion_tokens_total"] - before["exo_completion_tokens_total"] == 20
    assert after["exo_prompt_tokens_total"] - before["exo_prompt_tokens_total"] == 2 * prompt
    # every token after each first chunk is one gap (how many the first chunk holds depends on timing)
    assert 2 <= after["exo_inter_token_latency_seconds_count"] - before["exo_inter_token_latency_seconds_count"] <= 18
    assert after['exo_time_to_first_token_seconds_bucket{le="+Inf"}'] == after["exo_time_to_first_token_seconds_count"]
    # A stream ends with its last chunk; the task's end reaches State a moment later, and
    # heartbeats keep appending: compare gauges with a State read in the same quiet moment.
    def settled() -> tuple[dict, dict] | None:
        gauges, state, again = metric_values(http), http.get("/state").json(), metric_values(http)
        same = gauges["exo_events_applied"] == state["last_seq"] == again["exo_events_applied"]
        idle = all(t["status"] not in ("pending", "running") for t in state["tasks"].values())
        return (gauges, state) if same and idle else None

    after, state = wait_until(settled, 10, what="State and metrics at one sequence with no open task")
    for instance_id, instance in state["instances"].items():
        key = f'exo_instance_queue_depth{{instance_id="{instance_id}",model_id="{instance["model_id"]}"}}'
        assert after[key] == 0
    assert after['exo_runners{status="ready"}'] == len(state["runners"])
    assert after["exo_events_applied"] == state["last_seq"] and after["exo_follower_lag_events"] == 0
