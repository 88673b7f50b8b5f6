"""The control plane with 100 simulated nodes: the real master and API, and the real worker code
on every node with a fake runner at its edge (tests/support/simulated_nodes.py)."""

from __future__ import annotations

from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from exo.core.events import InstanceCreated, TaskCreated, TaskFinished
from exo.core.state import encode_state
from tests.support.cluster import NatsServer, replay, start_node, state_of, wait_until
from tests.support.simulator import FAKE_MODEL, SimulatorProcess, fake_model_dir

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
    wait_until(lambda: all((t := state_of(head).tasks.get(task_id)) is not None and t.status == "completed"
                           for task_id in task_ids), 30, what="every task finished in State")
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


def not_least_busy(seen: list, ours: set[str]) -> list[tuple[int, str]]:
    """The task.created events (seq, task) whose instance was not a least busy one in any State the
    master could have decided from. The master decides from a State that holds at least its own
    previous task.created, and perhaps some of the task.finished appended since (folded or not
    yet): so the chosen instance must have had the fewest open tasks at one point of that window."""
    open_tasks: Counter[str] = Counter()
    instance_of: dict[str, str] = {}
    least_in_window: set[str] = set()
    wrong = []

    def least() -> set[str]:
        fewest = min(open_tasks.values())
        return {instance for instance, count in open_tasks.items() if count == fewest}

    for seq, event, used in seen:
        if not used:
            continue
        if isinstance(event, InstanceCreated):
            open_tasks[event.instance.instance_id] += 0  # known, with nothing open
        elif isinstance(event, TaskCreated) and event.task.task_id in ours:
            instance = instance_of[event.task.task_id] = event.task.instance_id
            if instance not in least_in_window | least():
                wrong.append((seq, event.task.task_id))
            open_tasks[instance] += 1
            least_in_window = least()
        elif isinstance(event, TaskFinished) and event.task_id in ours:
            open_tasks[instance_of[event.task_id]] -= 1
            least_in_window |= least()
    return wrong
