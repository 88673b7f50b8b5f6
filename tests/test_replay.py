"""`exo replay` against a real nats-server: it rebuilds exactly the State live nodes fold, at the
end and at any --until, from the stream or from an export file, from a snapshot or from the
start; --verify agrees with honest snapshots and names the sequence and path of a corrupted one;
garbage and impossible events are listed and never stop it. Plus the pure pieces it is made of."""

from __future__ import annotations

import base64
import json
import os
import re
import subprocess
from pathlib import Path

import httpx
import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from exo.bus.connection import connect
from exo.bus.provision import provision
from exo.bus.server.permissions import OPERATOR_USER
from exo.bus.snapshots import write_snapshot
from exo.bus.tooling.log_reader import LogRecord
from exo.core.events import encode_event
from exo.core.state import SkippedEvent, State, encode_state
from exo.core.types import NodeInfo, Task
from exo.tools.event_view import EventFilter, describe, event_refs, matches, parse_filters
from exo.tools.export_format import decode_line, encode_line, format_time_ns, parse_time_ns
from exo.tools.replay import BatchReplayer
from exo.tools.replay_fold import Checkpoint, Replayer
from exo.tools.state_diff import Change, format_change, state_changes
from tests.support.exo_process import ExoProcess, exo_command
from tests.support.exo_tools import (
    GARBAGE,
    GARBAGE_SEQ,
    IMPOSSIBLE_SEQ,
    SCRIPT,
    append_script,
    builtins,
    in_thread,
    json_lines,
    run_tool,
)
from tests.support.fake_hub import FakeHub
from tests.support.tiny_model import TINY_MODEL_ID, make_tiny_model
from tests.test_fold import EVENTS

# ---- the tool on a scripted log -------------------------------------------------------------


@pytest.fixture
async def scripted(fresh_nats: str):
    """A fresh server holding SCRIPT, the live States at every sequence, and a connection."""
    nc = await connect([fresh_nats], name="test-replay")
    await provision(nc)
    states = await append_script(nc)
    yield fresh_nats, states, nc
    await nc.close()


def _result(done) -> dict:
    """The last JSON line of a replay: its result (or verification)."""
    results = [line for line in json_lines(done.stdout) if line["type"] in ("result", "verify")]
    assert len(results) == 1, f"exit {done.returncode}: {done.stderr}"
    return results[0]


@pytest.mark.slow  # starts `exo replay` processes
async def test_replay_equals_the_live_state_and_lists_what_it_could_not_use(scripted):
    url, states, _ = scripted
    # A live node's view skipped the garbage and the impossible event and went on folding.
    assert [s.seq for s in states[len(SCRIPT)].skipped_events] == [GARBAGE_SEQ, IMPOSSIBLE_SEQ]
    done = await in_thread(run_tool, ["replay", "--json"], url)
    assert done.returncode == 0, done.stderr
    result = _result(done)
    assert result["state"] == builtins(states[len(SCRIPT)])
    assert (result["from_seq"], result["last_seq"], result["replayed"]) == (0, len(SCRIPT), len(SCRIPT))
    assert [s["seq"] for s in result["skipped"]] == [GARBAGE_SEQ, IMPOSSIBLE_SEQ]
    assert result["skipped"][0]["reason"].startswith("undecodable event on exo.events.task.started: ")
    assert result["skipped"][1]["reason"] == "unknown task ghost"

    text = await in_thread(run_tool, ["replay"], url)
    assert text.returncode == 0
    lines = text.stdout.splitlines()
    assert lines[0] == "2 event(s) not used:"
    assert re.fullmatch(rf" +{GARBAGE_SEQ}  undecodable event on exo\.events\.task\.started: .+", lines[1])
    assert lines[2] == f"{'':>2}{IMPOSSIBLE_SEQ:>8}  unknown task ghost"
    assert lines[3] == f"State as of sequence {len(SCRIPT)}:"
    assert msgspec.json.decode("\n".join(lines[4:])) == builtins(states[len(SCRIPT)])
    assert f"{len(SCRIPT)} events, State at sequence {len(SCRIPT)}, 2 not used" in text.stderr


@pytest.mark.slow  # starts `exo replay` processes
async def test_until_equals_the_state_live_nodes_had_at_that_sequence(scripted):
    url, states, _ = scripted
    for seq in (1, 3, GARBAGE_SEQ, IMPOSSIBLE_SEQ, 10):
        done = await in_thread(run_tool, ["replay", "--until", str(seq), "--json"], url)
        assert _result(done)["state"] == builtins(states[seq]), f"--until {seq}"


@pytest.mark.slow  # starts `exo replay` processes
async def test_export_then_offline_replay_equals_live(scripted, tmp_path: Path):
    url, states, _ = scripted
    export = tmp_path / "events.jsonl"
    done = await in_thread(run_tool, ["events", "export", "-o", str(export)], url)
    assert done.returncode == 0, done.stderr
    lines = json_lines(export.read_text())
    assert [line["seq"] for line in lines] == list(range(1, len(SCRIPT) + 1))
    assert base64.b64decode(lines[GARBAGE_SEQ - 1]["data_base64"]) == GARBAGE
    # The file needs no NATS: point --nats nowhere to prove it.
    offline = await in_thread(run_tool, ["replay", "--file", str(export), "--json", "--nats", "nats://127.0.0.1:1"])
    assert offline.returncode == 0, offline.stderr
    assert _result(offline)["state"] == builtins(states[len(SCRIPT)])
    assert [s["seq"] for s in _result(offline)["skipped"]] == [GARBAGE_SEQ, IMPOSSIBLE_SEQ]
    until = await in_thread(run_tool, ["replay", "--file", str(export), "--until", "5", "--json"])
    assert _result(until)["state"] == builtins(states[5])


@pytest.mark.slow  # starts `exo replay` processes
async def test_diff_prints_what_each_event_changed(scripted):
    url, states, _ = scripted
    done = await in_thread(run_tool, ["replay", "--diff", "--filter", "command=t1"], url)
    assert done.returncode == 0, done.stderr
    without_times = [re.sub(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", "TIME", line) for line in done.stdout.splitlines()]
    per_event = without_times[: without_times.index("2 event(s) not used:")]
    headers = {
        4: "       4  TIME  task.created           term=1 command_id=t1 task_id=t1 instance_id=i1 model_id=org/m status=pending",
        5: "       5  TIME  task.started           task_id=t1",
        7: "       7  TIME  task.finished          task_id=t1 status=completed finish_reason=length completion_tokens=7",
    }
    # Exactly the events of command t1, each followed by what it changed between the States a live node had.
    assert per_event == [
        line for seq, header in headers.items()
        for line in [header, *("          " + format_change(c) for c in state_changes(states[seq - 1], states[seq]))]
    ]
    assert '          ~ tasks.t1.status: "pending" -> "running"' in per_event
    assert '          ~ tasks.t1.status: "running" -> "completed"' in per_event
    assert "          ~ tasks.t1.completion_tokens: 0 -> 7" in per_event
    assert any(line.startswith('          + tasks.t1 = {"task_id":"t1","instance_id":"i1"') for line in per_event)


@pytest.mark.slow  # starts `exo replay` processes
async def test_list_filters_by_kind_node_and_instance(scripted):
    url, _, _ = scripted

    async def listed(*filters: str) -> list[int]:
        done = await in_thread(run_tool, ["replay", "--list", *[f"--filter={f}" for f in filters]], url)
        assert done.returncode == 0, done.stderr
        return [int(line.split()[0]) for line in done.stdout.splitlines() if re.match(r" +\d+  \d{4}-", line)]

    assert await listed("kind=task.*") == [4, 5, GARBAGE_SEQ, 7, 8]  # garbage sent on a task subject counts
    assert await listed("instance=i1") == [2, 3, 4, 5, 7, 10]  # task.started/finished via the task's instance
    assert await listed("node=n1", "kind=runner.*") == [3]
    assert await listed("kind=card.*", "command=c-uncard") == [11]


@pytest.mark.slow  # starts `exo replay` processes
async def test_verify_agrees_with_honest_snapshots_then_names_a_corrupted_one(scripted):
    url, states, nc = scripted
    assert await write_snapshot(nc, states[4]) and await write_snapshot(nc, states[7])
    honest = await in_thread(run_tool, ["replay", "--verify"], url)
    assert honest.returncode == 0, honest.stdout + honest.stderr
    assert honest.stdout.splitlines()[-3:] == [
        "snapshot revision 1 at sequence 4: agrees with the replay",
        "snapshot revision 2 at sequence 7: agrees with the replay",
        "verify: all 2 snapshot(s) agree with the replay",
    ]
    t1 = states[9].tasks["t1"]
    corrupted = msgspec.structs.replace(
        states[9], tasks={**states[9].tasks, "t1": msgspec.structs.replace(t1, status="failed")})
    assert await write_snapshot(nc, corrupted)
    caught = await in_thread(run_tool, ["replay", "--verify"], url)
    assert caught.returncode == 1
    assert caught.stdout.splitlines()[-2:] == [
        'snapshot revision 3 at sequence 9: DIFFERS at tasks.t1.status: replay has "completed", snapshot has "failed"',
        "verify: FAILED: the replay first diverges from a snapshot at sequence 9, at tasks.t1.status",
    ]
    as_json = _result(await in_thread(run_tool, ["replay", "--verify", "--json"], url))
    assert as_json["agrees"] is False
    assert [(c["seq"], c["agrees"], c["path"]) for c in as_json["checks"]] == [
        (4, True, ""), (7, True, ""), (9, False, "tasks.t1.status")]

    await (await nc.jetstream().key_value("exo-state")).put("snapshot", b"not a State")
    unreadable = await in_thread(run_tool, ["replay", "--verify"], url)
    assert unreadable.returncode == 1
    assert re.search(r"^snapshot revision 4 is not a State: .+$", unreadable.stdout, re.M)


@pytest.mark.slow  # starts `exo replay` processes
async def test_from_snapshot_starts_at_the_latest_snapshot_at_or_before_until(scripted):
    url, states, nc = scripted
    # A node only the snapshot has: seeing it in the result proves the replay started there.
    marked = msgspec.structs.replace(states[5], nodes={**states[5].nodes, "only-in-snapshot": NodeInfo(node_id="x")})
    assert await write_snapshot(nc, marked)
    done = await in_thread(run_tool, ["replay", "--from-snapshot", "--until", "9", "--json"], url)
    result = _result(done)
    assert (result["from_seq"], result["replayed"], result["last_seq"]) == (5, 4, 9)
    assert set(result["state"]["nodes"]) == {"only-in-snapshot"}
    assert result["state"]["tasks"] == builtins(states[9])["tasks"]
    assert "on top of a snapshot at 5" in done.stderr

    before = await in_thread(run_tool, ["replay", "--from-snapshot", "--until", "4", "--json"], url)
    assert _result(before)["state"] == builtins(states[4])
    assert "no stored snapshot at or before 4; replaying from the start" in before.stderr


@pytest.mark.slow  # starts `exo replay` processes
async def test_a_trimmed_log_needs_a_snapshot_and_says_so(scripted):
    url, states, nc = scripted
    await nc.jetstream().purge_stream("EXO_EVENTS", seq=6)  # sequences 1-5 are gone
    done = await in_thread(run_tool, ["replay"], url)
    assert done.returncode == 2
    assert done.stderr.strip() == "exo replay: the event stream starts at sequence 6; sequences from 1 are gone"
    nothing = await in_thread(run_tool, ["replay", "--verify"], url)
    assert nothing.returncode == 2 and "no kept snapshot reaches it" in nothing.stderr

    for seq in (3, 5, 9):
        assert await write_snapshot(nc, states[seq])
    from_snapshot = await in_thread(run_tool, ["replay", "--from-snapshot", "--json"], url)
    assert _result(from_snapshot)["state"] == builtins(states[len(SCRIPT)])
    verify = await in_thread(run_tool, ["replay", "--verify"], url)
    assert verify.returncode == 0, verify.stdout + verify.stderr
    assert "verifying from snapshot revision 2 (sequence 5); 1 older snapshot(s) not checked" in verify.stderr
    assert verify.stdout.splitlines()[-2:] == [
        "snapshot revision 3 at sequence 9: agrees with the replay",
        "verify: all 1 snapshot(s) agree with the replay",
    ]


@pytest.mark.slow  # starts `exo replay` processes
def test_bad_arguments_are_one_line_and_exit_2():
    done = run_tool(["replay", "--filter", "colour=red"])
    assert done.returncode == 2
    assert "bad filter 'colour=red': use KEY=VALUE with KEY one of kind, node, instance, command" in done.stderr
    assert run_tool(["replay", "--verify", "--until", "3"]).returncode == 2
    unreachable = run_tool(["replay", "--nats", "nats://127.0.0.1:1"])
    assert unreachable.returncode == 2
    assert unreachable.stderr.startswith("exo replay: cannot connect to NATS at nats://127.0.0.1:1")


# ---- the pure pieces ------------------------------------------------------------------------


def _task(task_id: str, status: str = "pending") -> Task:
    return Task(task_id=task_id, instance_id="i", model_id="m", status=status)


def test_state_changes_name_added_removed_and_changed_paths():
    before = State(tasks={"a": _task("a"), "b": _task("b")}, custom_model_cards={})
    after = msgspec.structs.replace(before, last_seq=9, tasks={"a": _task("a", "running"), "c": _task("c")})
    changes = state_changes(before, after)
    assert [(c.op, c.path) for c in changes] == [
        ("changed", ("tasks", "a", "status")), ("removed", ("tasks", "b")), ("added", ("tasks", "c"))]
    assert [format_change(c) for c in changes][:2] == ['~ tasks.a.status: "pending" -> "running"', "- tasks.b"]
    assert state_changes(before, msgspec.structs.replace(before, last_seq=5)) == []  # last_seq is not a change


def test_a_bounded_list_that_drops_one_and_appends_one_is_shown_as_such():
    before = State(skipped_events=[SkippedEvent(seq=n, reason="r") for n in (1, 2, 3)])
    after = State(skipped_events=[SkippedEvent(seq=n, reason="r") for n in (2, 3, 4)])
    assert state_changes(before, after) == [
        Change(op="removed", path=("skipped_events", 0), before={"seq": 1, "reason": "r"}),
        Change(op="added", path=("skipped_events", 2), after={"seq": 4, "reason": "r"}),
    ]
    assert format_change(Change(op="added", path=("custom_model_cards", "org/m"), after=1)) == \
        '+ custom_model_cards["org/m"] = 1'


def test_filters_match_by_kind_pattern_node_instance_and_command():
    event_filter = parse_filters(["kind=task.*", "instance=i1", "instance=i2"])
    assert event_filter == EventFilter(kind=("task.*",), instance=("i1", "i2"))
    created, started = SCRIPT[3], SCRIPT[4]
    assert matches(event_filter, "task.created", created, None)
    assert not matches(event_filter, "task.started", started, None)  # names only the task ...
    context = State(tasks={"t1": msgspec.structs.replace(_task("t1"), instance_id="i1")})
    assert matches(event_filter, "task.started", started, context)  # ... whose instance State knows
    assert event_refs(SCRIPT[1], None) == {"node": {"n1"}, "instance": {"i1"}, "command": {"c-place"}}
    assert matches(parse_filters(["kind=task.*"]), "task.started", None, None)  # undecodable: by subject
    assert not matches(parse_filters(["node=n1"]), "task.started", None, None)
    with pytest.raises(ValueError, match="bad filter 'node'"):
        parse_filters(["node"])
    assert describe(SCRIPT[2]) == "runner_id=r1 instance_id=i1 node_id=n1 status=ready"


def test_export_lines_keep_events_pretty_json_and_garbage_exactly():
    event = LogRecord(seq=3, subject="exo.events.task.started", time_ns=1_764_672_000_123_456_789,
                      headers={"Nats-Msg-Id": "e3"}, data=b'{"kind":"task.started","task_id":"t"}')
    line = encode_line(event)
    assert line == (b'{"seq":3,"subject":"exo.events.task.started","time":"2025-12-02T10:40:00.123456789Z",'
                    b'"headers":{"Nats-Msg-Id":"e3"},"event":{"kind":"task.started","task_id":"t"}}\n')
    assert decode_line(line) == event
    pretty = msgspec.structs.replace(event, data=b'{\n  "kind": "task.started",\n  "task_id": "t"\n}', headers=None)
    assert line.count(b"\n") == 1 and decode_line(encode_line(pretty)).data == b'{"kind":"task.started","task_id":"t"}'
    garbage = msgspec.structs.replace(event, data=b"\xff\x00 not json", headers=None)
    assert b'"data_base64":"/wAgbm90IGpzb24="' in encode_line(garbage)
    assert decode_line(encode_line(garbage)) == garbage
    assert parse_time_ns(format_time_ns(1_764_672_000_000_000_001)) == 1_764_672_000_000_000_001
    assert format_time_ns(1_764_672_000_123_456_789, digits=3) == "2025-12-02T10:40:00.123Z"


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(items=st.lists(st.one_of(EVENTS, EVENTS, st.just(None)), max_size=40), data=st.data())
def test_batch_feeding_gives_what_feeding_one_record_at_a_time_gives(items: list, data):
    """`exo replay` feeds whole socket reads to one Draft: same State, same list of what it
    could not use (garbage, impossible events, missing and repeated sequences), same checks
    against snapshots (agreeing and corrupted ones, reached and not) as `Replayer.feed`."""
    records, seq = [], 0
    for item in items:
        seq += data.draw(st.sampled_from([1, 1, 1, 2, 0]), label="step")  # 2: a gap, 0: a repeat
        payload = GARBAGE if item is None else encode_event(item)
        records.append(LogRecord(seq=max(seq, 1), subject="exo.events.x", time_ns=0, headers=None, data=payload))
    truth = Replayer()
    states = {}
    for record in records:
        truth.feed(record)
        states[truth.state.last_seq] = truth.state
    checkpoints = [Checkpoint(revision=n, state=states[s]) for n, s in enumerate(sorted(states)[::3])]
    checkpoints += [Checkpoint(revision=98, state=msgspec.structs.replace(State(), last_seq=2)),
                    Checkpoint(revision=99, state=State(last_seq=10_000))]  # corrupted; never reached
    one_by_one, batched = Replayer(checkpoints=checkpoints), BatchReplayer(checkpoints=checkpoints)
    for record in records:
        one_by_one.feed(record)
    cuts = sorted(data.draw(st.sets(st.integers(0, len(records)), max_size=5), label="cuts"))
    for start, stop in zip([0, *cuts], [*cuts, len(records)]):
        batched.feed_all(records[start:stop])
    assert encode_state(batched.state) == encode_state(one_by_one.state)
    assert batched.skipped == one_by_one.skipped and batched.replayed == one_by_one.replayed
    assert batched.checks == one_by_one.checks
    assert batched.unreached_checkpoints == one_by_one.unreached_checkpoints


# ---- a real node: replay equals what it folded live ------------------------------------------


@pytest.mark.slow  # a real exo node with a model
def test_replay_of_a_cluster_session_equals_the_live_state(tmp_path: Path):
    """Card add, place, chat, a cancelled chat, delete, a local card added and deleted: after
    each step `exo replay --until <the node's last_seq>` equals the node's own State; the whole
    log replays to its final State, from the stream and from an export; --verify passes."""
    hub = FakeHub({TINY_MODEL_ID: make_tiny_model(tmp_path / "model")})
    hub.start()
    env = {"HF_ENDPOINT": hub.endpoint, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_DISABLE_TELEMETRY": "1"}
    node = ExoProcess(tmp_path / "data", env).start()
    try:
        url = node.nats_url(OPERATOR_USER)  # the tools need only the read-only operator
        with httpx.Client(base_url=node.url, timeout=120) as http:
            seen = _run_session(http, tmp_path / "model")
        for live in seen:
            done = run_tool(["replay", "--until", str(live["last_seq"]), "--json"], url)
            assert _result(done)["state"] == live, f"--until {live['last_seq']}"
        final = msgspec.json.decode(httpx.get(f"{node.url}/state").content)
        export = tmp_path / "session.jsonl"
        assert run_tool(["events", "export", "--until", str(final["last_seq"]), "-o", str(export)], url).returncode == 0
        offline = run_tool(["replay", "--file", str(export), "--json"])
        assert _result(offline)["state"] == final
        verify = run_tool(["replay", "--verify"], url)
        assert verify.returncode == 0, verify.stdout + verify.stderr
    finally:
        node.interrupt()
        hub.stop()


def _run_session(http: httpx.Client, model_dir: Path) -> list[dict]:
    """Drive the node through a session; the node's /state after each step."""
    seen = []

    def step(response: httpx.Response) -> dict:
        assert response.status_code == 200, response.text
        seen.append(http.get("/state").json())
        return response.json()

    step(http.post("/models/add", json={"model_id": TINY_MODEL_ID}))
    instance_id = step(http.post("/place_instance", json={"model_id": TINY_MODEL_ID}))["instance_id"]
    chat = {"model": TINY_MODEL_ID, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 8}
    step(http.post("/v1/chat/completions", json=chat))
    with http.stream("POST", "/v1/chat/completions", json={**chat, "max_tokens": 2000, "stream": True}) as streamed:
        assert streamed.status_code == 200, streamed.read()
        first = next(line for line in streamed.iter_lines() if line.startswith("data: {"))
        task_id = json.loads(first.removeprefix("data: "))["id"].removeprefix("chatcmpl-")
        assert step(http.post(f"/v1/cancel/{task_id}"))["status"] == "cancelled"
    assert seen[-1]["tasks"][task_id]["status"] == "cancelled"
    step(http.delete(f"/instance/{instance_id}"))
    step(http.post("/models/add", json={"model_id": "local/tiny", "path": str(model_dir)}))
    step(http.delete("/models/custom/local/tiny"))
    return seen


@pytest.mark.slow  # starts an `exo replay` process
async def test_tools_find_their_nodes_server_from_exo_home_alone(tmp_path: Path):
    """A node whose embedded server is not on 4222: `exo replay` with only EXO_HOME set reads that
    node's ports file (it used to dial 127.0.0.1:4222 and fail)."""
    from exo.bus.server.embedded import EmbeddedNats

    server = EmbeddedNats(tmp_path / "home" / "nats", port=0)
    url = await server.start()
    try:
        nc = await connect([url], name="t")
        await provision(nc)
        await nc.close()
        env = {k: v for k, v in os.environ.items() if k != "EXO_NATS_URL"} | {"EXO_HOME": str(tmp_path / "home")}
        done = await in_thread(subprocess.run, [*exo_command(), "replay", "--json"], capture_output=True, text=True,
                               timeout=60, env=env)
        assert done.returncode == 0, done.stderr
        assert _result(done)["last_seq"] == 0
    finally:
        server.stop()
