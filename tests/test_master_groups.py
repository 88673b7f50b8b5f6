"""Master groups on three real nodes and one nats-server (issue #34, part 2): two groups serve
their models exactly (mlx-lm's text), each request in its own group's log; kill -9 of one
group's master pauses that group only; a node that joins late catches up on both groups."""

from __future__ import annotations

import asyncio
import json
import re
import statistics
import threading
import time
from pathlib import Path

import httpx
import pytest

from exo.bus.connection import connect
from exo.core.state import State, decode_state
from tests.support.cluster import NatsServer, node_process, start_node, state_of, wait_until
from tests.support.e2e import Reference
from tests.support.exo_process import ExoProcess, interrupt_all, start_all
from tests.support.exo_tools import json_lines, run_tool
from tests.support.tiny_model import make_tiny_model

pytestmark = pytest.mark.slow

ALPHA, BETA = "local/alpha", "local/beta"
PROMPT = [{"role": "user", "content": "tell me about the sea"}]
ENV = {"EXO_MASTER_GROUPS": f"alpha={ALPHA},beta={BETA}", "EXO_HEARTBEAT_S": "0.5", "EXO_SNAPSHOT_EVERY": "4"}


def node_id(node: ExoProcess) -> str:
    return httpx.get(f"{node.url}/node_id", timeout=10).json()


def group_state(node: ExoProcess, group: str) -> State | None:
    answer = httpx.get(f"{node.url}/state", params={"group": group}, timeout=30)
    return decode_state(answer.content) if answer.status_code == 200 else None


def leader_of(node: ExoProcess, group: str) -> str:
    state = group_state(node, group)
    return state.leader_node if state is not None else ""


def chat(api: ExoProcess, model: str, max_tokens: int = 16, timeout: float = 120) -> httpx.Response:
    body = {"model": model, "messages": PROMPT, "max_tokens": max_tokens, "temperature": 0}
    return httpx.post(f"{api.url}/v1/chat/completions", json=body, timeout=timeout)


def text_of(answer: httpx.Response) -> str:
    assert answer.status_code == 200, answer.text
    return answer.json()["choices"][0]["message"]["content"]


def messages_on(nats_url: str, stream: str, subject: str) -> int:
    async def count() -> int:
        nc = await connect([nats_url], name="test-count")
        try:
            info = await nc.jetstream().stream_info(stream, subjects_filter=subject)
            return sum((info.state.subjects or {}).values())  # state.messages counts the whole stream
        finally:
            await nc.close()
    return asyncio.run(count())


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("models") / "tiny")


@pytest.fixture(scope="module")
def reference(model_dir) -> Reference:
    return Reference(model_dir)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, model_dir):
    """n1 leads the shared log and group alpha; n2 leads beta and stands by for alpha (EXO_LEAD_GROUPS);
    n3 is the worker. All three serve the API."""
    root = tmp_path_factory.mktemp("groups")
    nats = NatsServer(root / "nats")
    started: list[ExoProcess] = []  # stopped at the end, even when the set-up fails half-way
    try:
        n1 = start_node(root, "n1", nats.url, "--no-worker", env=ENV | {"EXO_LEAD_GROUPS": "alpha"})
        started.append(n1)
        wait_until(lambda: leader_of(n1, "alpha") == node_id(n1) and state_of(n1).leader_node == node_id(n1), 60,
                   what="n1 leads the shared log and group alpha")
        # the worker's start need not wait for n2's (only n1 must lead first)
        n2, n3 = start_all([node_process(root, "n2", nats.url, "--no-worker", env=ENV | {"EXO_LEAD_GROUPS": "beta,alpha"}),
                            node_process(root, "n3", nats.url, "--no-master", env=ENV)])
        started += [n2, n3]
        wait_until(lambda: leader_of(n2, "beta") == node_id(n2), 60, what="n2 leads group beta")
        with httpx.Client(base_url=n1.url, timeout=120) as http:
            wait_until(lambda: len(state_of(n1).nodes) == 1, 30, what="the worker registered")
            for model in (ALPHA, BETA):
                assert http.post("/models/add", json={"model_id": model, "path": str(model_dir)}).status_code == 200
                placed = http.post("/place_instance", json={"model_id": model, "wait": 120})
                assert placed.status_code == 200, placed.text
        yield {"nats": nats, "n1": n1, "n2": n2, "n3": n3, "root": root}
    finally:
        interrupt_all(started[::-1])
        nats.stop()


def test_two_groups_serve_exactly_and_each_request_lands_in_its_groups_log(cluster, reference):
    expected = reference.chat(PROMPT, 16)
    for api in (cluster["n1"], cluster["n2"], cluster["n3"]):
        for model in (ALPHA, BETA):
            assert text_of(chat(api, model)) == expected
    n3 = cluster["n3"]
    alpha, beta = group_state(n3, "alpha"), group_state(n3, "beta")
    assert alpha is not None and beta is not None
    assert {t.model_id for t in alpha.tasks.values()} == {ALPHA} and len(alpha.tasks) == 3
    assert {t.model_id for t in beta.tasks.values()} == {BETA} and len(beta.tasks) == 3
    assert {t.status for s in (alpha, beta) for t in s.tasks.values()} == {"completed"}  # the worker's events went there
    url = cluster["nats"].url
    assert messages_on(url, "EXO_EVENTS", "exo.events.task.>") == 0  # none in the shared log
    assert messages_on(url, "EXO_EVENTS_alpha", "exo.group.alpha.events.task.created") == 3
    assert set(state_of(n3).tasks) == set(alpha.tasks) | set(beta.tasks)  # the cluster view has both
    answer = chat(cluster["n1"], BETA)  # a group's finished generation replays whole, from another node
    with httpx.stream("GET", f"{n3.url}/v1/chat/completions/{answer.json()['id']}/stream", timeout=60) as replayed:
        chunks = [json.loads(line[6:]) for line in replayed.iter_lines() if line.startswith("data: {")]
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]) == expected


def test_replay_per_group_and_all_together_equals_what_nodes_hold(cluster):
    n3, url = cluster["n3"], cluster["nats"].url
    for group in ("alpha", "beta"):
        done = run_tool(["replay", "--group", group, "--json"], url)
        assert done.returncode == 0, done.stderr
        replayed = json_lines(done.stdout)[-1]["state"]
        held = group_state(n3, group)
        assert held is not None and replayed["tasks"].keys() == held.tasks.keys()
        assert replayed["last_seq"] == held.last_seq and replayed["group"] == group
        verified = run_tool(["replay", "--group", group, "--verify"], url)  # against the group's snapshots
        assert verified.returncode == 0 and "agree with the replay" in verified.stdout, verified.stdout + verified.stderr
    together = run_tool(["replay", "--all-groups", "--json"], url)
    assert together.returncode == 0, together.stderr
    state = json_lines(together.stdout)[-1]["state"]
    assert state["tasks"].keys() == state_of(n3).tasks.keys() and len(state["tasks"]) == 7
    assert run_tool(["replay", "--group", "Not A Group"], url).returncode == 2
    with httpx.stream("GET", f"{n3.url}/events", params={"group": "beta", "since": 0}, timeout=30) as feed:
        kinds = []
        for line in feed.iter_lines():
            if line.startswith("event: "):
                kinds.append(line.removeprefix("event: "))
            if kinds.count("task.finished") == 4:
                break
    assert kinds[0] == "leader.elected" and kinds.count("task.created") == 4
    assert httpx.get(f"{n3.url}/events", params={"group": "nope"}, timeout=30).status_code == 404


def test_a_cancel_goes_to_the_log_that_holds_the_request(cluster):
    n3 = cluster["n3"]
    body = {"model": ALPHA, "messages": PROMPT, "max_tokens": 30_000, "stream": True}  # the card's context: 32768
    with httpx.Client(base_url=n3.url, timeout=120) as http, http.stream("POST", "/v1/chat/completions", json=body) as stream:
        lines = (line for line in stream.iter_lines() if line.startswith("data: {"))
        command_id = json.loads(next(lines)[6:])["id"].removeprefix("chatcmpl-")
        cancelled = http.post(f"/v1/cancel/{command_id}")
    assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled", cancelled.text
    alpha = group_state(n3, "alpha")
    assert alpha is not None and alpha.tasks[command_id].status == "cancelled" and alpha.tasks[command_id].cancel_requested
    url = cluster["nats"].url
    assert messages_on(url, "EXO_EVENTS_alpha", "exo.group.alpha.events.task.cancel_requested") == 1


class Sender:
    """Greedy requests for one model, one after another, each timed, until stopped."""

    def __init__(self, api: ExoProcess, model: str) -> None:
        self.api, self.model = api, model
        self.results: list[tuple[float, float, str]] = []  # (started, seconds, text or error)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            answer = chat(self.api, self.model, max_tokens=4, timeout=60)
            text = answer.json()["choices"][0]["message"]["content"] if answer.status_code == 200 else answer.text
            self.results.append((started, time.monotonic() - started, text))

    def __enter__(self) -> Sender:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(90)


def test_kill_9_of_one_groups_master_pauses_only_that_group(cluster, reference):
    n1, n2, n3 = cluster["n1"], cluster["n2"], cluster["n3"]
    expected = reference.chat(PROMPT, 4)
    with Sender(n3, BETA) as beta:
        wait_until(lambda: len(beta.results) >= 10, 60, what="beta's requests flowing")
        n1.process.kill()  # kill -9: the shared master and group alpha's
        killed_at = time.monotonic()
        alpha = chat(n3, ALPHA, max_tokens=4)  # waits for alpha's next master
        alpha_s = time.monotonic() - killed_at
    assert text_of(alpha) == expected
    assert leader_of(n3, "alpha") == node_id(n2)
    before = [s for started, s, _ in beta.results if started < killed_at]
    during = [(s, text) for started, s, text in beta.results if killed_at <= started < killed_at + alpha_s]
    assert len(during) >= 5 and all(text == expected for _, text in during), during
    during_s = sorted(s for s, _ in during)
    p99 = during_s[min(len(during_s) - 1, int(0.99 * len(during_s)))]
    print(f"\nalpha paused {alpha_s:.1f} s; beta meanwhile: {len(during)} requests, p50 "
          f"{statistics.median(during_s) * 1000:.0f} ms, p99 {p99 * 1000:.0f} ms, max {during_s[-1] * 1000:.0f} ms "
          f"(before the kill: p50 {statistics.median(before) * 1000:.0f} ms, max {max(before) * 1000:.0f} ms)")
    assert alpha_s > 3 * during_s[-1]  # alpha waited for a new master; beta never did


def test_a_late_joiner_catches_up_on_both_groups(cluster):
    n3 = cluster["n3"]
    late = start_node(cluster["root"], "late", cluster["nats"].url, "--no-master", "--no-worker", env=ENV)
    try:
        for group in ("alpha", "beta"):
            mine, theirs = group_state(late, group), group_state(n3, group)
            assert mine is not None and theirs is not None
            assert mine.tasks == theirs.tasks and mine.last_seq == theirs.last_seq
            caught = re.search(rf"EXO_EVENTS_{group} caught up to sequence (\d+) from a snapshot at (\d+)", late.output())
            assert caught and int(caught.group(2)) > 0, late.output()[-3000:]  # started from the group's snapshot
        assert set(state_of(late).tasks) == set(state_of(n3).tasks)
    finally:
        late.interrupt()


def test_a_worker_only_node_follows_the_groups_of_its_ranks_only(cluster, reference):
    n3 = cluster["n3"]
    worker = start_node(cluster["root"], "worker-only", cluster["nats"].url, "--no-master", "--no-api", env=ENV)
    try:
        time.sleep(2)
        assert "following master group" not in worker.output()  # no ranks here yet: no group log folded
        placed = httpx.post(f"{n3.url}/place_instance", json={"model_id": ALPHA, "replicas": 2, "wait": 120}, timeout=150)
        assert placed.status_code == 200, placed.text
        wait_until(lambda: "following master group alpha's log" in worker.output(), 30, what="the worker follows alpha")
        expected = reference.chat(PROMPT, 16)
        assert all(text_of(chat(n3, ALPHA)) == expected for _ in range(4))  # some on the new node's instance
        alpha = group_state(n3, "alpha")
        assert alpha is not None and {t.status for t in alpha.tasks.values()} <= {"completed", "cancelled"}
        assert "following master group beta" not in worker.output()
    finally:
        worker.interrupt()


def test_a_model_moved_to_another_group_keeps_its_instances(cluster, reference):
    """The map is the shared master's setting: a new shared master with beta's model in alpha moves
    it. Instances are in the shared log, so beta's instance serves on; its next request is alpha's."""
    n2, n3 = cluster["n2"], cluster["n3"]
    instance = next(i.instance_id for i in state_of(n3).instances.values() if i.model_id == BETA)
    moved = ENV | {"EXO_MASTER_GROUPS": f"alpha={ALPHA}|{BETA}", "EXO_LEAD_GROUPS": "alpha"}
    n5 = start_node(cluster["root"], "n5", cluster["nats"].url, "--no-worker", env=moved)
    try:
        n2.interrupt()  # hands its leases back: n5 leads the shared log, writes its map, and leads alpha
        wait_until(lambda: state_of(n3).groups == {"alpha": [ALPHA, BETA]}, 60, what="the new map in the log")
        wait_until(lambda: leader_of(n3, "alpha") == node_id(n5), 60, what="n5 leads alpha")
        assert text_of(chat(n3, BETA)) == reference.chat(PROMPT, 16)
        alpha, beta = group_state(n3, "alpha"), group_state(n3, "beta")
        assert alpha is not None and beta is not None  # beta's log is still followed: its history stays
        assert [t.model_id for t in alpha.tasks.values()].count(BETA) == 1
        assert next(i.instance_id for i in state_of(n3).instances.values() if i.model_id == BETA) == instance
    finally:
        n5.interrupt()


def test_a_node_off_the_shared_lease_leads_only_its_groups(cluster):
    """EXO_LEAD_SHARED=0: no campaign for the shared log (and no pulses heard), even with no other
    candidate left (n1 killed, n2 and n5 stopped by the tests before); it leads group beta."""
    n6 = start_node(cluster["root"], "n6", cluster["nats"].url, "--no-worker",
                    env=ENV | {"EXO_LEAD_GROUPS": "beta", "EXO_LEAD_SHARED": "0"})
    try:
        wait_until(lambda: leader_of(n6, "beta") == node_id(n6), 60, what="n6 leads group beta")
        time.sleep(3)  # time enough to have taken a free shared lease, had it campaigned
        assert state_of(n6).leader_node != node_id(n6)
        assert "master of group beta: leading" in n6.output() and "master: leading" not in n6.output()
    finally:
        n6.interrupt()
