"""Running `exo <tool>` the way an operator does (a separate process), and a scripted event log
with the State a live node folds at every sequence, for the operator-tool tests."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import uuid
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

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
from exo.core.ids import CommandId, InstanceId, ModelId, NodeId, RunnerId, TaskId
from exo.core.state import State
from exo.core.types import Instance, ModelCard, ShardAssignment, Task
from tests.support.exo_process import exo_command

GARBAGE = b"this is not an event {"
P = ParamSpec("P")
R = TypeVar("R")


def run_tool(args: list[str], nats_url: str | None = None, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "EXO_NATS_URL": nats_url} if nats_url else dict(os.environ)
    return subprocess.run([*exo_command(), *args], capture_output=True, text=True, timeout=timeout, env=env)


def json_lines(stdout: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in stdout.splitlines() if line.strip()]


def builtins(state: State) -> dict[str, Any]:
    as_dict: dict[str, Any] = msgspec.to_builtins(state)  # a Struct's builtins: a dict keyed by field name
    return as_dict


# (what to append, its event id). None stands for garbage published by hand on exo.events.task.started.
SCRIPT: list[AnyEvent | None] = [
    LeaderElected(node_id=NodeId("n1"), lease_revision=1),  # 1: term 1, stamped on the master's events below
    InstanceCreated(command_id=CommandId("c-place"), term=1, instance=Instance(  # 2
        instance_id=InstanceId("i1"), model_id=ModelId("org/m"),
        shards=[ShardAssignment(runner_id=RunnerId("r1"), node_id=NodeId("n1"), end_layer=4)])),
    RunnerStatusChanged(runner_id=RunnerId("r1"), instance_id=InstanceId("i1"), node_id=NodeId("n1"),  # 3
                        status="ready"),
    TaskCreated(command_id=CommandId("t1"), term=1,  # 4
                task=Task(task_id=TaskId("t1"), instance_id=InstanceId("i1"), model_id=ModelId("org/m"))),
    TaskStarted(task_id=TaskId("t1")),  # 5
    None,  # 6 garbage
    TaskFinished(task_id=TaskId("t1"), status="completed", finish_reason="length", completion_tokens=7),  # 7
    TaskStarted(task_id=TaskId("ghost")),  # 8 impossible
    CustomCardAdded(command_id=CommandId("c-card"), term=1, card=ModelCard(model_id=ModelId("org/custom"), n_layers=2)),  # 9
    InstanceDeleted(command_id=CommandId("c-delete"), term=1, instance_id=InstanceId("i1")),  # 10
    CustomCardDeleted(command_id=CommandId("c-uncard"), term=1, model_id=ModelId("org/custom")),  # 11
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


async def in_thread(function: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> R:
    """Run a blocking call (a tool process) without stopping this test's event loop."""
    return await asyncio.to_thread(function, *args, **kwargs)
