"""Running `exo <tool>` the way an operator does (a separate process), and a scripted event log
with the State a live node folds at every sequence, for the operator-tool tests."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import uuid

import msgspec
from nats.aio.client import Client

from exo.bus.event_log import EventLog
from exo.bus.state_view import StateView
from exo.bus.subjects import EVENTS_STREAM
from exo.core.events import (
    AnyEvent,
    CustomCardAdded,
    CustomCardDeleted,
    InstanceCreated,
    InstanceDeleted,
    LeaderElected,
    RunnerStatusChanged,
    TaskCreated,
    TaskFinished,
    TaskStarted,
)
from exo.core.state import State
from exo.core.types import Instance, ModelCard, ShardAssignment, Task
from tests.support.exo_process import exo_command

GARBAGE = b"this is not an event {"


def run_tool(args: list[str], nats_url: str | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    env = {**os.environ, "EXO_NATS_URL": nats_url} if nats_url else dict(os.environ)
    return subprocess.run([*exo_command(), *args], capture_output=True, text=True, timeout=timeout, env=env)


def json_lines(stdout: str) -> list[dict]:
    return [json.loads(line) for line in stdout.splitlines() if line.strip()]


def builtins(state: State) -> dict:
    return msgspec.to_builtins(state)


# (what to append, its event id). None stands for garbage published by hand on exo.events.task.started.
SCRIPT: list[AnyEvent | None] = [
    LeaderElected(node_id="n1", lease_revision=1),  # 1: term 1, stamped on the master's events below
    InstanceCreated(command_id="c-place", term=1, instance=Instance(                        # 2
        instance_id="i1", model_id="org/m", shards=[ShardAssignment(runner_id="r1", node_id="n1", end_layer=4)])),
    RunnerStatusChanged(runner_id="r1", instance_id="i1", node_id="n1", status="ready"),     # 3
    TaskCreated(command_id="t1", term=1, task=Task(task_id="t1", instance_id="i1", model_id="org/m")),  # 4
    TaskStarted(task_id="t1"),                                                               # 5
    None,                                                                                    # 6 garbage
    TaskFinished(task_id="t1", status="completed", finish_reason="length", completion_tokens=7),  # 7
    TaskStarted(task_id="ghost"),                                                            # 8 impossible
    CustomCardAdded(command_id="c-card", term=1, card=ModelCard(model_id="org/custom", n_layers=2)),  # 9
    InstanceDeleted(command_id="c-delete", term=1, instance_id="i1"),                        # 10
    CustomCardDeleted(command_id="c-uncard", term=1, model_id="org/custom"),                 # 11
]
GARBAGE_SEQ, IMPOSSIBLE_SEQ = 6, 8


async def append_script(nc: Client) -> dict[int, State]:
    """Append SCRIPT to a fresh log; returns the State a live StateView had at each sequence."""
    view = StateView(nc)
    await view.start()
    log, js = EventLog(nc), nc.jetstream()
    states: dict[int, State] = {}
    try:
        for event in SCRIPT:
            if event is None:
                seq = (await js.publish("exo.events.task.started", GARBAGE, stream=EVENTS_STREAM)).seq
            else:
                seq = await log.append(event, event_id=uuid.uuid4().hex)
            states[seq] = await view.wait_for(seq)
    finally:
        await view.stop()
    assert sorted(states) == list(range(1, len(SCRIPT) + 1)), "the script needs a fresh event log"
    return states


async def in_thread(function, *args, **kwargs):
    """Run a blocking call (a tool process) without stopping this test's event loop."""
    return await asyncio.to_thread(function, *args, **kwargs)
