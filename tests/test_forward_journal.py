"""What a worker's runners were given survives the worker (exo/worker/forward_journal.py): a worker
that restarts fails the tasks its earlier runners had begun instead of running them again, without
one `task.started` event per request in the log; a task still running after a second is announced
there for operators."""

from __future__ import annotations

import asyncio
from pathlib import Path

from exo.bus.connection import connect
from exo.bus.event_log import EventLog
from exo.bus.provision import provision
from exo.bus.state_view import StateView
from exo.core.events import CustomCardAdded, InstanceCreated, NodeRegistered, TaskCreated
from exo.core.state import State
from exo.core.types import Instance, ModelCard, NodeInfo, ShardAssignment, Task
from exo.models.dirs import DownloadSettings
from exo.settings.services import ModelSettings
from exo.worker.forward_journal import ForwardJournal
from exo.worker.service import Worker
from tests.conftest import eventually
from tests.support.as_master import TEST_TERM, with_leader
from tests.support.fake_runner import FakeRunner
from tests.support.simulator import fake_model_dir


def test_the_journal_round_trips_ignores_what_is_no_task_run_and_compacts(tmp_path: Path):
    path = tmp_path / "worker" / "forwarded"
    journal = ForwardJournal(path)
    assert journal.load() == {}  # none yet
    assert journal.note("t1", 0) and journal.note("t2", 0) and journal.note("t3", 1) and journal.note("t1", 2)
    assert ForwardJournal(path).load() == {"t1": 2, "t2": 0, "t3": 1}  # a task's latest run
    with path.open("ab") as file:  # a hostile or broken file: garbage, no run, an overlong line, control characters
        file.write(b"\xff\xfe garbage 3\nno-run\n" + b"x" * 500 + b" 0\nbad\x07id 1\nt4 -1\nt5 99999999\n\n")
    assert ForwardJournal(path).load() == {"t1": 2, "t2": 0, "t3": 1, "\ufffd\ufffd garbage": 3}
    journal.compact({"t2": 0})
    assert ForwardJournal(path).load() == {"t2": 0}
    assert journal.note("t4", 1) and ForwardJournal(path).load() == {"t2": 0, "t4": 1}


def test_a_journal_that_cannot_be_written_says_so(tmp_path: Path):
    (tmp_path / "worker").write_text("a file where the folder should be")
    assert not ForwardJournal(tmp_path / "worker" / "forwarded").note("t1", 0)


async def test_a_restarted_worker_fails_what_its_runners_had_begun_and_runs_what_they_had_not(
        fresh_nats, tmp_path: Path):
    """The first life's runner is given a task and the worker dies under a second into it; the second
    life fails that task and runs one created meanwhile, which takes 1.5 s: only that one is announced
    in the log as started (once), the other never was."""
    client = await connect([fresh_nats], name="journal")
    await provision(client)
    log = EventLog(client)
    data_dir, node = tmp_path / "data", "node-j"
    card = ModelCard(model_id="sim/journal", path=str(fake_model_dir(tmp_path / "model")), n_layers=4,
                     storage_bytes=10**6)
    instance = Instance(instance_id="i1", model_id=card.model_id, shards=[
        ShardAssignment(runner_id="r1", node_id=node, start_layer=0, end_layer=4)])
    given: list[list[str]] = [[], []]  # what each life's runner was asked to generate

    def runner_of(life: int, delay_s: float):
        def make(runner_id):
            runner = FakeRunner(runner_id, client, delay_s=delay_s)
            send = runner.send

            async def recording(request):
                if type(request).__name__ == "Generate":
                    given[life].append(request.task_id)
                await send(request)
            runner.send = recording  # type: ignore[method-assign]
            return runner
        return make

    async def life(n: int, delay_s: float) -> tuple[Worker, asyncio.Task]:
        worker = Worker(client, view, node, data_dir, [fresh_nats], {},
                        DownloadSettings.of(ModelSettings(offline=True, model_sharing=False), data_dir),
                        runner_factory=runner_of(n, delay_s))
        return worker, asyncio.create_task(worker.run())

    view = StateView(client, with_leader(State()))
    await view.start()
    first = second = None
    try:
        for n, event in enumerate([CustomCardAdded(card=card, term=TEST_TERM), NodeRegistered(node=NodeInfo(node_id=node)),
                                   InstanceCreated(instance=instance, term=TEST_TERM),
                                   TaskCreated(task=Task(task_id="begun", instance_id="i1", model_id=card.model_id),
                                               term=TEST_TERM)]):
            seq = await log.append(event, f"journal-{n}")
        await view.wait_for(seq)
        worker, first = await life(0, delay_s=60)  # the generation outlives this worker
        await eventually(lambda: given[0] == ["begun"], 20)
        await asyncio.sleep(0.2)
        assert view.state.tasks["begun"].status == "pending"  # no task.started in the log: under a second
        first.cancel()
        await asyncio.gather(first, return_exceptions=True)
        await worker.stop()
        worker.kill_runners()

        seq = await log.append(TaskCreated(task=Task(task_id="after", instance_id="i1", model_id=card.model_id),
                                           term=TEST_TERM), "journal-after")
        await view.wait_for(seq)
        worker, second = await life(1, delay_s=1.5)
        await eventually(lambda: view.state.tasks["after"].status == "completed"
                         and view.state.tasks["begun"].status == "failed", 20)
        assert view.state.tasks["begun"].error == "its runner restarted mid-generation"
        assert given[1] == ["after"]  # the begun one was not run a second time
        events = [await _event(client, s) for s in range(1, view.state.last_seq + 1)]
        assert [e.task_id for e in events if type(e).__name__ == "TaskStarted"] == ["after"]
    finally:
        for running in (first, second):
            if running is not None:
                running.cancel()
                await asyncio.gather(running, return_exceptions=True)
        await view.stop()
        await client.close()


async def _event(client, seq: int):
    from exo.core.events import decode_event
    return decode_event((await client.jetstream().get_msg("EXO_EVENTS", seq)).data)
