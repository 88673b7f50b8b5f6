"""`exo events tail` and `exo events export` against a real nats-server, run as an operator runs them."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import uuid

import pytest

from exo.bus.connection import connect
from exo.bus.event_log import EventLog
from exo.bus.provision import provision
from exo.bus.subjects import EVENTS_STREAM
from exo.core.events import NodeRegistered, TaskCreated, TaskStarted, encode_event
from exo.core.types import NodeInfo, Task
from tests.support.exo_process import exo_command
from tests.support.exo_tools import GARBAGE, in_thread, json_lines, run_tool

pytestmark = pytest.mark.slow  # every test starts `exo events` processes

TIME = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z"


@pytest.fixture
async def log(fresh_nats: str):
    """A fresh server and a connection that appends without a consumer of its own, so the
    tests can tell when a `tail` process has subscribed (the stream's consumer count)."""
    nc = await connect([fresh_nats], name="test-events")
    await provision(nc)
    yield fresh_nats, nc
    await nc.close()


def start_tail(url: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen([*exo_command(), "events", "tail", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "EXO_NATS_URL": url})


async def wait_for_consumers(nc, count: int, process: subprocess.Popen) -> None:
    for _ in range(500):
        if (await nc.jetstream().stream_info(EVENTS_STREAM)).state.consumer_count >= count:
            return
        assert process.poll() is None, process.communicate()
        await asyncio.sleep(0.02)
    raise AssertionError("tail did not subscribe")


async def test_tail_follows_new_events_one_line_each(log):
    url, nc = log
    events = EventLog(nc)
    await events.append(TaskCreated(command_id="old", task=Task(task_id="old", instance_id="i", model_id="m")), "old")
    tail = start_tail(url, "--filter", "kind=task.*", "--count", "3")
    await wait_for_consumers(nc, 1, tail)
    await events.append(NodeRegistered(node=NodeInfo(node_id="n1")), uuid.uuid4().hex)  # 2: filtered out
    await events.append(TaskCreated(command_id="t1", task=Task(task_id="t1", instance_id="i1", model_id="m")), "e3")
    await events.append(TaskStarted(task_id="t1"), uuid.uuid4().hex)  # 4
    await nc.jetstream().publish("exo.events.task.started", GARBAGE, stream=EVENTS_STREAM)  # 5
    await events.append(TaskStarted(task_id="never-shown"), uuid.uuid4().hex)  # 6: after --count 3
    out, err = await in_thread(tail.communicate, timeout=30)
    assert tail.returncode == 0, err
    lines = out.splitlines()
    assert len(lines) == 4, out
    assert re.fullmatch(rf"       3  {TIME}  task\.created           command_id=t1 task_id=t1 instance_id=i1 model_id=m "
                        r"status=pending", lines[0])
    assert re.fullmatch(rf"       4  {TIME}  task\.started           task_id=t1", lines[1])
    assert re.fullmatch(rf"       5  {TIME}  task\.started", lines[2])
    assert lines[3].startswith("          ! skipped: undecodable: JSON is malformed")


async def test_tail_from_a_sequence_as_json_prints_export_lines(log):
    url, nc = log
    events = EventLog(nc)
    for n in range(4):
        await events.append(TaskStarted(task_id=f"t{n}"), f"e{n}")
    exported = await in_thread(run_tool, ["events", "export", "--from", "2", "--until", "3"], url)
    assert exported.returncode == 0 and exported.stderr.strip() == "exo events: exported 2 events"
    since = start_tail(url, "--since", "2", "--count", "2", "--json")
    out, err = await in_thread(since.communicate, timeout=30)
    assert since.returncode == 0, err
    assert out == exported.stdout
    last = start_tail(url, "--last", "1", "--count", "1", "--json")
    out, _ = await in_thread(last.communicate, timeout=30)
    assert [line["seq"] for line in json_lines(out)] == [4]


async def test_export_is_one_event_per_line_with_sequence_subject_time_and_headers(log):
    url, nc = log
    event = TaskStarted(task_id="t1")
    seq = await EventLog(nc).append(event, "the-event-id")
    done = await in_thread(run_tool, ["events", "export"], url)
    (line,) = done.stdout.splitlines()
    parsed = json.loads(line)
    assert set(parsed) == {"seq", "subject", "time", "headers", "event"}
    assert (parsed["seq"], parsed["subject"]) == (seq, "exo.events.task.started")
    assert parsed["headers"]["Nats-Msg-Id"] == "the-event-id"
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{9}Z", parsed["time"])
    assert line.endswith(',"event":' + encode_event(event).decode() + "}")  # the payload, byte for byte


async def test_tail_stops_cleanly_on_ctrl_c(log):
    url, nc = log
    tail = start_tail(url)
    await wait_for_consumers(nc, 1, tail)
    tail.send_signal(signal.SIGINT)
    out, err = await in_thread(tail.communicate, timeout=10)
    assert (tail.returncode, out, err) == (0, "", "")
