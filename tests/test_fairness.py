"""The worker's batch slots count rows (exo/worker/fairness.py): a task of n choices (or best_of
candidates) takes n of EXO_MAX_BATCH's slots, as the runner decodes n rows for it; the next task
waits for its rows (the ones behind it with it, so a wide one is not starved), and one wider than
the whole batch goes alone once the runner is empty. Pure: Tasks in, Tasks out."""

from __future__ import annotations

from exo.core.requests import GenerationParams
from exo.core.state import State
from exo.core.types import Instance, ShardAssignment, Task
from exo.worker.fairness import next_to_forward
from exo.worker.plan import ForwardTask, LocalRunner, WorkerView, plan

MODEL = "org/model"


def task(n: int, key_id: str, rows: int = 1, best_of: int = 0) -> Task:
    return Task(task_id=f"t{n}", instance_id="i", model_id=MODEL, created_at=1000.0 + n, key_id=key_id,
                params=GenerationParams(n=rows, best_of=best_of))


def test_a_task_of_n_choices_takes_n_slots():
    running = [task(0, "key_a", rows=4)]
    three, one = task(1, "key_b", rows=3), task(2, "key_c")
    assert next_to_forward([three, one], running, 8) == [three, one]  # 4 + 3 + 1 rows: the batch of 8, full
    assert next_to_forward([three, one], [*running, task(3, "key_d")], 8) == [three]  # one row left: none fits
    assert next_to_forward([task(4, "key_b", best_of=5)], running, 8) == []  # best_of's candidates are rows too


def test_the_next_task_waits_for_its_rows_and_the_smaller_ones_behind_it_wait_too():
    wide, small = task(1, "key_b", rows=6), task(2, "key_c")
    running = [task(0, "key_a", rows=4)]
    assert next_to_forward([wide, small], running, 8) == []  # 4 free: the older, wider one is next, and waits
    assert next_to_forward([wide, small], [], 8) == [wide, small]


def test_a_task_wider_than_the_batch_goes_alone_once_the_runner_is_empty():
    huge, after = task(1, "key_a", rows=16), task(2, "key_b")
    assert next_to_forward([huge, after], [], 8) == [huge]
    assert next_to_forward([huge, after], [task(0, "key_c")], 8) == []
    assert next_to_forward([after], [huge], 8) == []  # it holds every row until it ends


def test_fairness_between_keys_counts_their_rows():
    running = [task(0, "key_a", rows=4), task(1, "key_b"), task(2, "key_b")]
    waiting = [task(3, "key_a"), task(4, "key_b")]  # key_a's is older, but key_a holds 4 rows to key_b's 2
    assert next_to_forward(waiting, running, 7) == [waiting[1]]


def test_the_worker_forwards_what_its_runners_free_rows_hold():
    instance = Instance(instance_id="i", model_id=MODEL, shards=[ShardAssignment(runner_id="r", node_id="n")])
    tasks = [task(0, "key_a", rows=3), task(1, "key_a", rows=2), task(2, "key_a", rows=2), task(3, "key_a")]
    state = State(instances={"i": instance}, tasks={t.task_id: t for t in tasks})
    local = LocalRunner(runner_id="r", instance_id="i", phase="ready", forwarded=frozenset({"t0"}))
    view = WorkerView(node_id="n", state=state, runners={"r": local}, batch_slots=6)
    assert [s.task_id for s in plan(view) if isinstance(s, ForwardTask)] == ["t1"]  # 3 + 2 of 6: t2's 2 rows wait
