"""The master's routing cost per request: `choose_instance` (exo/master/routing.py) over a State
that keeps 1,100 tasks (1,000 finished and the open ones, each a conversation of its own) with
100 candidate instances, as bench/scale.py's load leaves it at 1,000 nodes. py-spy put this scan
at ~18% of the master's samples there (2026-12-05). Prints microseconds per call, median
[min-max] over the runs, without the master's TaskIndex (a scan of every kept task) and with it
(each call on a State with one more task than the last, as the master sees them).

    uv run python -m bench.routing [--tasks 1100] [--instances 100] [--runs 7] [--calls 200]
"""

from __future__ import annotations

import argparse
import statistics
import time

import msgspec

from exo.core.conversation import digest_conversation
from exo.core.ids import InstanceId, ModelId, TaskId
from exo.core.requests import ChatMessage, GenerationParams
from exo.core.state import State
from exo.core.types import Instance, Task
from exo.master.routing import TaskIndex, choose_instance


def crowded_state(tasks: int, instances: int) -> tuple[State, list[Instance]]:
    candidates = [Instance(instance_id=InstanceId(f"i{n}"), model_id=ModelId("m")) for n in range(instances)]
    kept: dict[TaskId, Task] = {}
    for n in range(tasks):
        params = GenerationParams(messages=[ChatMessage(role="user", content=f"request {n}")])
        kept[TaskId(f"t{n}")] = Task(task_id=TaskId(f"t{n}"), instance_id=InstanceId(f"i{n % instances}"),
                                     model_id=ModelId("m"), params=params, conversation=digest_conversation(params),
                                     status="completed")
    return State(tasks=kept, instances={i.instance_id: i for i in candidates}), candidates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", type=int, default=1100)
    parser.add_argument("--instances", type=int, default=100)
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args()
    state, candidates = crowded_state(args.tasks, args.instances)
    params = GenerationParams(messages=[ChatMessage(role="user", content="a new request")])
    open_tasks = {i.instance_id: 0 for i in candidates}
    states = [_with_one_more(state, n) for n in range(args.calls)]  # made ahead: not timed
    index = TaskIndex()
    choose_instance(state, candidates, params, open_tasks, index=index)  # the master builds it once
    for label, with_index in (("scan", None), ("TaskIndex", index)):
        runs: list[float] = []
        for _ in range(args.runs):
            started = time.perf_counter()
            for each in states:
                choose_instance(each, candidates, params, open_tasks, index=with_index)
            runs.append((time.perf_counter() - started) / args.calls * 1e6)
        print(f"choose_instance, {label}: {statistics.median(runs):.0f} us [{min(runs):.0f}-{max(runs):.0f}] per "
              f"call (n = {args.runs} runs of {args.calls}), {args.tasks} tasks kept, {args.instances} candidates")


def _with_one_more(state: State, n: int) -> State:
    params = GenerationParams(messages=[ChatMessage(role="user", content=f"another request {n}")])
    task = Task(task_id=TaskId(f"new{n}"), instance_id=InstanceId("i0"), model_id=ModelId("m"), params=params,
                conversation=digest_conversation(params))
    return msgspec.structs.replace(state, tasks={**state.tasks, task.task_id: task})

if __name__ == "__main__":
    main()
