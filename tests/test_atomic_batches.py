"""The master appends a batch of decisions as one JetStream atomic batch (exo/bus/atomic_append.py):
one round trip, all or none. Against a real nats-server: the batch lands contiguously; a batch the
server refuses is decided again command by command (a bad event fails its own command only); a
commit whose answer is lost ends the term, and every command is still decided exactly once."""

from __future__ import annotations

import asyncio
import json
import os
import signal

from exo.bus.atomic_append import AtomicAppendFailed, append_atomically
from exo.bus.connection import connect
from exo.bus.event_log import EventLog
from exo.bus.provision import provision
from exo.core.commands import GenerateText
from exo.core.events import LeaderElected, TaskCreated, TaskStarted
from exo.core.requests import ChatMessage, GenerationParams
from exo.core.types import ModelCard
from exo.master.service import Master
from exo.settings.services import MasterSettings
from tests.conftest import eventually
from tests.test_bus import placed_then_waiting

BUILTIN = {"org/m": ModelCard(model_id="org/m", n_layers=2, storage_bytes=1000)}


async def _log(nc, first: int = 1):
    js, last = nc.jetstream(), (await EventLog(nc).last_sequence())
    return [(seq, await js.get_msg("EXO_EVENTS", seq)) for seq in range(first, last + 1)]

# The placed node has no worker to pulse: on a loaded machine a test outlasting EXO_SUSPECT_S (5 s)
# saw its instance's node suspect and the requests refused (a full run beside other work did).
UNSUSPECTING = MasterSettings(suspect_s=600.0)


async def _stop(master: asyncio.Task, view, nc) -> None:
    master.cancel()
    await asyncio.wait({master}, timeout=10)
    await view.stop()
    await nc.close()


async def test_a_batch_of_decisions_lands_contiguously_as_one_atomic_batch(fresh_nats):
    nc = await connect([fresh_nats], name="atomic")
    await provision(nc)
    assert await EventLog(nc).check_atomic()  # streams/EXO_EVENTS.json allows atomic batches
    commands = [GenerateText(command_id=f"atomic-{n}", model_id="org/m") for n in range(10)]
    view, answers = await placed_then_waiting(nc, "atomic", BUILTIN, commands)
    master = asyncio.create_task(Master(nc, view, BUILTIN, node_id="atomic", settings=UNSUSPECTING).run())
    try:
        await eventually(lambda: all(c.command_id in answers for c in commands), 20)
        created = {seq: msg for seq, msg in await _log(nc) if msg.subject == "exo.events.task.created"}
        assert len(created) == 10, answers  # a refusal names its reason
        assert max(created) - min(created) == 9  # contiguous: nothing came between
        assert len({msg.headers["Nats-Batch-Id"] for msg in created.values()}) == 1
        assert [msg.headers["Nats-Batch-Sequence"] for msg in created.values()] == [str(n) for n in range(1, 11)]
        assert sorted(json.loads(msg.data)["command_id"] for msg in created.values()) == sorted(c.command_id for c in commands)
    finally:
        await _stop(master, view, nc)


async def test_a_refused_batch_is_decided_again_command_by_command_and_a_bad_event_fails_alone(fresh_nats):
    """The stream refuses messages over 4 KiB: the batch holding one request of 8 KiB is refused as a
    whole (nothing stored); the master decides it again appending command by command, so the nine
    others are admitted, each once, and the big one alone is answered with the broker's refusal."""
    nc = await connect([fresh_nats], name="refused")
    await provision(nc)
    info = await nc.request("$JS.API.STREAM.INFO.EXO_EVENTS", b"")
    config = {**json.loads(info.data)["config"], "max_msg_size": 4096}
    assert "error" not in json.loads((await nc.request("$JS.API.STREAM.UPDATE.EXO_EVENTS", json.dumps(config).encode())).data)
    big = GenerationParams(messages=[ChatMessage(role="user", content="x" * 8192)])
    commands = [GenerateText(command_id=f"refused-{n}", model_id="org/m", params=big if n == 4 else GenerationParams())
                for n in range(10)]
    view, answers = await placed_then_waiting(nc, "refused", BUILTIN, commands)
    start = await EventLog(nc).last_sequence()
    master = asyncio.create_task(Master(nc, view, BUILTIN, node_id="refused", settings=UNSUSPECTING).run())
    try:
        await eventually(lambda: all(c.command_id in answers for c in commands), 30)
        kinds = [json.loads(msg.data)["kind"] for _, msg in await _log(nc, start + 1)]
        assert kinds.count("leader.elected") == 1  # a refusal stored nothing: no election needed
        outcomes = {c.command_id: answers[c.command_id] for c in commands}
        assert all(len(events) == 1 for events in outcomes.values())  # each decided once
        assert [type(outcomes[f"refused-{n}"][0]).__name__ for n in range(10)] == \
            ["TaskCreated"] * 4 + ["CommandRejected"] + ["TaskCreated"] * 5
        assert "maximum" in outcomes["refused-4"][0].reason  # the server's words: message size exceeds maximum
    finally:
        await _stop(master, view, nc)


async def test_a_commit_whose_answer_is_lost_ends_the_term_and_every_command_is_decided_once(fresh_server,
                                                                                            monkeypatch):
    """The server is paused while the master commits (SIGSTOP): the commit times out unanswered (in
    1 s here, well within the master's lease), and it lands once the server resumes. The master cannot
    know, so it elects itself again: the batch, stored before that election, counts, and the
    redelivered commands are answered from State. Their view lags the log by 20 ms an event, so a
    master that decided them again without an election would decide on a State without the batch."""
    monkeypatch.setattr("exo.bus.atomic_append.COMMIT_TIMEOUT_S", 1.0)
    nc = await connect([fresh_server.url], name="lost-ack")
    await provision(nc)
    commands = [GenerateText(command_id=f"lost-{n}", model_id="org/m") for n in range(6)]
    view, answers = await placed_then_waiting(nc, "lost-ack", BUILTIN, commands)
    assert fresh_server.process is not None
    pid, paused = fresh_server.process.pid, []

    class PausedAtCommit(Master):
        async def confirm(self) -> None:
            if not paused:
                paused.append(self.term)
                os.kill(pid, signal.SIGSTOP)
                asyncio.get_running_loop().call_later(1.5, os.kill, pid, signal.SIGCONT)
            await super().confirm()

    async def slow_fold(seq, event, state) -> None:
        await asyncio.sleep(0.02)

    view.add_listener(slow_fold)
    start = await EventLog(nc).last_sequence()
    master = asyncio.create_task(PausedAtCommit(nc, view, BUILTIN, node_id="lost-ack", settings=UNSUSPECTING).run())
    try:
        await eventually(lambda: all(c.command_id in answers for c in commands), 40)
        await asyncio.sleep(2)  # anything decided twice would be appended by now
        events = [(seq, json.loads(msg.data)) for seq, msg in await _log(nc, start + 1)]
        created = [(seq, e) for seq, e in events if e["kind"] == "task.created"]
        assert sorted(e["command_id"] for _, e in created) == sorted(c.command_id for c in commands)  # once each
        elections = [seq for seq, e in events if e["kind"] == LeaderElected.__struct_config__.tag]
        assert all(e["term"] == paused[0] for _, e in created)  # the batch counted, in the term that decided it
        assert len(elections) >= 2 and created[-1][0] < elections[-1]  # and the master elected itself again after
        assert all(isinstance(answers[c.command_id][0], TaskCreated) for c in commands)
    finally:
        os.kill(pid, signal.SIGCONT)
        await _stop(master, view, nc)


async def test_append_atomically_is_all_or_none_and_says_why(nc):
    first = await EventLog(nc).last_sequence() + 1
    last = await append_atomically(nc, [TaskStarted(task_id=f"all-{n}") for n in range(3)])
    assert last == first + 2
    too_big = [TaskStarted(task_id="fits"), TaskStarted(task_id="x" * nc.max_payload)]  # over the server's max payload
    try:
        await append_atomically(nc, too_big)
        raise AssertionError("a batch with a message over the max payload was taken")
    except AtomicAppendFailed as error:
        assert error.stored_none and "payload" in str(error).lower()
    assert await EventLog(nc).last_sequence() == last  # the first one was not stored either


async def test_a_batch_decides_on_its_own_staged_decisions_even_when_others_events_came_meanwhile(fresh_nats):
    """A batch's decisions are folded at sequences only planned: a worker's event folded by the view
    meanwhile takes the first of them. The next command must still be decided on the batch's
    decisions (here: the one place in the queue is taken), not on the view that lacks them."""
    from exo.core.events import NodeRegistered
    from exo.core.types import NodeInfo

    nc = await connect([fresh_nats], name="staged")
    await provision(nc)
    view, answers = await placed_then_waiting(nc, "staged", BUILTIN, [])
    master = Master(nc, view, BUILTIN, node_id="staged", settings=MasterSettings(max_queue=1, suspect_s=600.0))
    running = asyncio.create_task(master.run())
    try:
        await eventually(lambda: master.term > 0 and view.state.leader_term == master.term, 20)
        await master.handle(GenerateText(command_id="staged-a", model_id="org/m"))
        seq = await EventLog(nc).append(NodeRegistered(node=NodeInfo(node_id="another")), "staged-other")
        await view.wait_for(seq)  # the view now holds an event at the sequence planned for staged-a's
        await master.handle(GenerateText(command_id="staged-b", model_id="org/m"))
        await master.confirm()
        await eventually(lambda: "staged-a" in answers and "staged-b" in answers, 10)
        assert isinstance(answers["staged-a"][0], TaskCreated)
        assert answers["staged-b"][0].code == "overloaded"  # the queue of one was staged-a's
    finally:
        await _stop(running, view, nc)
