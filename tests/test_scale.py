"""The control plane with 100 simulated nodes: the real master and API, and the real worker code
on every node with a fake runner at its edge (tests/support/simulated_nodes.py)."""

from __future__ import annotations

from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from msgspec.structs import replace

from exo.core.commands import GenerateText
from exo.core.events import CommandRejected, InstanceCreated, TaskCreated, TaskFinished
from exo.core.state import encode_state
from tests.support.cluster import NatsServer, replay, start_node, state_of, wait_until
from tests.support.simulator import FAKE_MODEL, SimulatorProcess, fake_model_dir
from tests.test_decide import run
from tests.test_routing import chat, two_instances

pytestmark = pytest.mark.slow

NODES = 100
INSTANCES = 10
REQUESTS = 500


@pytest.fixture
def cluster(tmp_path: Path):
    nats = NatsServer(tmp_path / "nats")
    head = start_node(tmp_path, "head", nats.url, "--no-worker")
    # 5 ms per generation: how busy each instance was is read back from the log, not arranged by time
    simulator = SimulatorProcess(nats.url, NODES, tmp_path / "sim", tmp_path / "sim.log", delay_ms=5)
    try:
        simulator.wait_ready(120)
        yield nats, head, simulator
    finally:
        simulator.stop()
        head.interrupt()
        nats.stop()


def test_a_hundred_simulated_nodes_serve_every_request_exactly_once_and_state_is_the_logs(cluster, tmp_path):
    nats, head, simulator = cluster
    http = httpx.Client(base_url=head.url, timeout=60)
    wait_until(lambda: len(state_of(head).nodes) == NODES, 60, what="every simulated node in State")
    added = http.post("/models/add", json={"model_id": FAKE_MODEL, "path": str(fake_model_dir(tmp_path / "fake"))})
    assert added.status_code == 200, added.text
    for _ in range(INSTANCES):
        placed = http.post("/place_instance", json={"model_id": FAKE_MODEL})
        assert placed.status_code == 200, placed.text

    def all_ready() -> bool:
        state = state_of(head)
        return len(state.runners) == INSTANCES and all(r.status == "ready" for r in state.runners.values())

    wait_until(all_ready, 60, what="every runner ready")
    state = state_of(head)
    assert len({shard.node_id for i in state.instances.values() for shard in i.shards}) == INSTANCES  # spread out

    def ask(n: int) -> tuple[str, str, dict]:
        with httpx.Client(base_url=head.url, timeout=60) as client:
            answer = client.post("/v1/chat/completions", json={
                "model": FAKE_MODEL, "messages": [{"role": "user", "content": f"request {n}"}], "max_tokens": 8})
        assert answer.status_code == 200, answer.text
        body = answer.json()
        return body["id"].removeprefix("chatcmpl-"), body["choices"][0]["message"]["content"], body["usage"]

    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(ask, range(REQUESTS)))
    assert all(text == "t0 t1 t2 t3 " and usage["completion_tokens"] == 4 for _, text, usage in answers)
    task_ids = [task_id for task_id, _, _ in answers]
    assert len(set(task_ids)) == REQUESTS

    # A client has its answer with the last chunk; the worker's task.finished follows.
    def all_finished() -> bool:  # one State per look (not one per task: 500 reads of the whole State)
        tasks = state_of(head).tasks
        return all((t := tasks.get(task_id)) is not None and t.status == "completed" for task_id in task_ids)

    wait_until(all_finished, 30, what="every task finished in State")
    final = state_of(head)
    replayed, seen = replay(nats.url, final.last_seq)
    assert encode_state(replayed) == encode_state(final)  # State is the log's, exactly
    # Every one in the log, used or not: a task decided or reported twice would show here.
    created = Counter(e.task.task_id for _, e, _ in seen if isinstance(e, TaskCreated))
    finished = Counter(e.task_id for _, e, _ in seen if isinstance(e, TaskFinished))
    assert all(created[t] == 1 and finished[t] == 1 for t in task_ids)  # each decided once, answered once
    assert sum(created.values()) == REQUESTS and sum(finished.values()) == REQUESTS  # and nothing else ran
    assert all(used for _, e, used in seen if isinstance(e, (TaskCreated, TaskFinished)))
    assert not_least_busy(seen, set(task_ids)) == []  # routing's promise, however the load fell


def test_the_reading_of_least_busy_takes_a_batch_decided_before_a_task_finished_ahead_of_it_in_the_log():
    """Two instances with a task each; one finishes while the master decides a batch of three on the
    State before it. The log has the task.finished ahead of the batch, yet the batch's third decision
    (a tie in its State) is no least busy one in the State just after the second."""
    state, (first, second) = two_instances()
    log = [InstanceCreated(instance=state.instances[i]) for i in (first, second)]
    for task_id in ("t0", "t1", "t2", "t3", "t4"):
        state, (created,) = run(state, GenerateText(command_id=task_id, model_id="org/builtin",
                                                    params=chat(("user", f"request {task_id}"))))
        log.append(created)
    log.insert(4, TaskFinished(task_id="t1", status="completed"))  # appended while t2..t4 were decided
    assert [e.task.instance_id for e in log if isinstance(e, TaskCreated)] == [first, second, first, second, first]
    assert not_least_busy([(seq, e, True) for seq, e in enumerate(log, 1)], {"t0", "t1", "t2", "t3", "t4"}) == []


def test_the_reading_of_least_busy_finds_a_request_sent_to_a_busier_instance():
    state, (first, second) = two_instances()
    log = [InstanceCreated(instance=state.instances[i]) for i in (first, second)]
    for task_id in ("t0", "t1"):
        state, (created,) = run(state, GenerateText(command_id=task_id, model_id="org/builtin",
                                                    params=chat(("user", f"request {task_id}"))))
        log.append(replace(created, task=replace(created.task, instance_id=first)))
    assert not_least_busy([(seq, e, True) for seq, e in enumerate(log, 1)], {"t0", "t1"}) == [(4, "t1")]


def not_least_busy(seen: list, ours: set[str]) -> list[tuple[int, str]]:
    """The task.created events (seq, task) whose instance was not a least busy one in any State the
    master could have decided from. It decides a batch of commands on State as the batch began plus
    the batch's own decisions, and appends the batch contiguously (exo/bus/atomic_append.py). So a
    decision's State holds every earlier task.created, and the task.finished up to some point after
    the previous append: those appended since sit before the batch in the log, yet none of its
    decisions may have seen them. A task.finished between two task.created puts them in different
    appends, so the previous append ended at or before the task.created ahead of this run of them."""
    open_tasks: Counter[str] = Counter()
    instance_of: dict[str, str] = {}
    finished_since_created: list[str] = []  # the instances of the task.finished since the latest task.created
    maybe_unseen: list[str] = []  # those ahead of this run of task.created: perhaps not folded when it was decided
    in_run = False
    wrong = []
    for seq, event, used in seen:
        if isinstance(event, (TaskCreated, CommandRejected)):  # what a batch of requests appends
            if used and isinstance(event, TaskCreated) and event.task.task_id in ours:
                if not in_run:
                    maybe_unseen, in_run = finished_since_created, True
                finished_since_created = []
                instance = instance_of[event.task.task_id] = event.task.instance_id
                if not least_with_some_unseen(open_tasks, maybe_unseen, instance):
                    wrong.append((seq, event.task.task_id))
                open_tasks[instance] += 1
            continue
        in_run = False
        if used and isinstance(event, InstanceCreated):
            open_tasks[event.instance.instance_id] += 0  # known, with nothing open
        elif used and isinstance(event, TaskFinished) and event.task_id in ours:
            open_tasks[instance_of[event.task_id]] -= 1
            finished_since_created.append(instance_of[event.task_id])
    return wrong


def least_with_some_unseen(open_tasks: Counter[str], maybe_unseen: list[str], instance: str) -> bool:
    """Whether `instance` had the fewest open tasks with none, the first few or all of the task.finished
    of `maybe_unseen` (their instances, in log order) folded."""
    counts = open_tasks.copy()
    for finished_at in maybe_unseen:
        counts[finished_at] += 1  # none folded yet
    for finished_at in [*maybe_unseen, None]:
        if counts[instance] == min(counts.values()):
            return True
        if finished_at is not None:
            counts[finished_at] -= 1
    return False
