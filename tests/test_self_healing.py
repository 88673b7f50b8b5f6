"""Self-healing (issue #29) with nodes in their own processes: a node dies (kill -9 of exo and its
runners, and on a discovered cluster its nats-server too) or pauses (SIGSTOP) while it generates
a ~1,000-token streamed chat that a client reads from another node. The client's stream only
pauses: the generation moves to a replacement instance the master places on its own, which
prefills the prompt plus the tokens already streamed and goes on, so the whole text equals
mlx-lm's uninterrupted run exactly (greedy and seeded sampling), nothing given twice. State
shows the move, /metrics counts it; a pause shorter than EXO_SUSPECT_S moves nothing; with no
room left the desire says why it waits, and the generation goes on once the node is back.

Most cases run on one nats-server of the test's own with a head node (master and API, never
killed) and three workers: a killed worker is back in seconds for the next test. One case kills a
whole machine of a three-node discovered cluster (exo, runners and its nats-server).
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support.e2e import Reference
from tests.support.exo_process import ExoProcess
from tests.support.healing import (
    MODEL,
    NODE_TIMEOUT_S,
    SUSPECT_S,
    Cluster,
    SharedNatsCluster,
    Streamed,
    chat_body,
    kill_9,
    metric,
    node_id_of,
    pids_of,
    signal_all,
    state_of,
    stream_chat,
    wait_until,
)
from tests.support.tiny_model import Dims, make_tiny_model

pytestmark = pytest.mark.slow

# ~2 s of decoding on CPU: the node goes after CUT_AFTER_CHUNKS text chunks (~160 tokens on the
# 2-core test machine, ~8 a chunk), well inside; most of the text still comes from the replacement
# (_mid_stream fails a stream that ended first; the kills check text came after)
MAX_TOKENS = 600
# ranks in separate processes on two cores decode far slower (~16 tokens/s for three): cut after
# CUT_AFTER_CHUNKS, ~140 tokens still come from the replacement
PIPELINE_TOKENS = 160
SEA = [{"role": "user", "content": "tell me about the sea"}]
FOX = [{"role": "user", "content": "Tell me a joke about the quick brown fox"}]
AFTER = [{"role": "user", "content": "What is the capital of France?"}]
SEEDED = {"temperature": 0.8, "seed": 1234}
CUT_AFTER_CHUNKS = 20  # text chunks the client has read when the node goes


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("model") / "tiny4", Dims(layers=4))


@pytest.fixture(scope="module")
def reference(model_dir) -> Reference:
    return Reference(model_dir)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, model_dir) -> Iterator[SharedNatsCluster]:
    cluster = SharedNatsCluster(tmp_path_factory.mktemp("healing"), model_dir)
    try:
        yield cluster.start()
    finally:
        cluster.stop()


@pytest.fixture
def nodes(cluster) -> list[ExoProcess]:
    """The three worker nodes, all up, with nothing placed."""
    cluster.bring_back()
    cluster.clear(cluster.head)
    return cluster.nodes


@pytest.fixture
def discovered(tmp_path_factory, model_dir) -> Iterator[Cluster]:
    cluster = Cluster(tmp_path_factory.mktemp("discovered"), model_dir)
    try:
        yield cluster.start()
    finally:
        cluster.stop()


def _finished(stream: Streamed, timeout: float = 60) -> Streamed:
    assert stream.done.wait(timeout), f"the stream did not end in {timeout} s ({len(stream.text)} chars so far)"
    assert stream.status == 200 and not stream.errors, (stream.status, stream.errors)
    return stream


def _mid_stream(stream: Streamed) -> None:
    wait_until(lambda: stream.text_chunks() >= CUT_AFTER_CHUNKS or stream.done.is_set(), 60, 0.005,
               "the stream under way")
    assert not stream.done.is_set(), "the stream ended before the node could be stopped"


def _migrations(api: ExoProcess, task_id: str) -> list:
    return state_of(api).tasks[task_id].migrations


def _assert_healed(cluster: Cluster, api: ExoProcess, stream: Streamed, old_instance: str, gone: set[str],
                   migrations_before: float) -> str:
    """The task moved once, off `old_instance` to the desire's replacement on surviving nodes; the
    metric counts it. Returns the replacement's id."""
    # The stream's last chunk comes on the token stream; the worker's task.finished follows it into
    # the log, and the API node's State a moment later (a full run read "running" in between).
    wait_until(lambda: state_of(api).tasks[stream.task_id].status != "running", 10, 0.1, "the task's end in State")
    state = state_of(api)
    desire_id = next(iter(state.desires))
    task = state.tasks[stream.task_id]
    assert task.status == "completed" and len(task.migrations) == 1, task
    move = task.migrations[0]
    assert move.from_instance == old_instance and old_instance not in state.instances
    replacement = wait_until(lambda: [i for i in state_of(api).instances.values() if i.desire_id == desire_id], 30,
                             0.2, "the desire's replacement instance")[0]
    assert {s.node_id for s in replacement.shards}.isdisjoint(gone), replacement
    # the task went to the replacement (or waited for it: "" then the replacement)
    assert move.to_instance in ("", replacement.instance_id), (move, replacement.instance_id)
    wait_until(lambda: metric(api, "exo_migrations_total") >= migrations_before + 1, 10, 0.2, "exo_migrations_total")
    return replacement.instance_id


def _chat(api: ExoProcess, messages: list[dict], max_tokens: int) -> str:
    reply = httpx.post(f"{api.url}/v1/chat/completions", json=chat_body(messages, max_tokens), timeout=120)
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]["message"]["content"]


def _kill_mid_stream(cluster: Cluster, nodes: list[ExoProcess], body: dict, placement: dict | None = None,
                     victim_rank: int = 0) -> tuple[Streamed, ExoProcess, ExoProcess, str, float, float]:
    """Place, stream `body` from a node that survives, kill -9 the node of `victim_rank` once
    the stream is under way. Returns (stream, api node, victim, instance id, metric before, kill time)."""
    via = getattr(cluster, "head", nodes[0])
    instance_id = cluster.place(via, **(placement or {}))["instance_id"]
    hosts = cluster.hosts(instance_id, via)
    victim = hosts[victim_rank]
    api = getattr(cluster, "head", None) or next(n for n in [*hosts, *nodes] if n is not victim)  # one that survives
    before = metric(api, "exo_migrations_total")
    stream = stream_chat(api.url, body)
    _mid_stream(stream)
    kill_9(victim)
    return stream, api, victim, instance_id, before, time.monotonic()


def test_a_killed_node_s_generation_goes_on_elsewhere_with_the_exact_greedy_text(cluster, nodes, reference):
    _killed_machine_goes_on(cluster, nodes, reference)


def test_a_killed_machine_of_a_discovered_cluster_nats_server_included(discovered, reference):
    _killed_machine_goes_on(discovered, discovered.nodes, reference)


def _killed_machine_goes_on(cluster: Cluster, nodes: list[ExoProcess], reference: Reference) -> None:
    expected = reference.chat(SEA, MAX_TOKENS)
    stream, api, victim, instance_id, before, killed_at = _kill_mid_stream(cluster, nodes, chat_body(SEA, MAX_TOKENS))
    _finished(stream)
    assert stream.first_text_after(killed_at) is not None  # cut inside, not after the end
    assert stream.text == expected
    assert stream.finish_reason == "length"
    _assert_healed(cluster, api, stream, instance_id, {node_id_of(victim)}, before)
    assert _chat(api, AFTER, 40) == reference.chat(AFTER, 40)


def test_a_seeded_sampled_generation_goes_on_with_mlx_lm_s_seeded_text(cluster, nodes, reference):
    expected = reference.sampled_chat(FOX, MAX_TOKENS, seed=SEEDED["seed"], temperature=SEEDED["temperature"])
    body = chat_body(FOX, MAX_TOKENS) | SEEDED
    stream, api, victim, instance_id, before, killed_at = _kill_mid_stream(cluster, nodes, body)
    _finished(stream)
    assert stream.first_text_after(killed_at) is not None
    assert stream.text == expected
    assert stream.finish_reason == "length"
    _assert_healed(cluster, api, stream, instance_id, {node_id_of(victim)}, before)


def test_a_pipeline_that_loses_a_rank_is_placed_again_on_the_two_survivors(cluster, nodes, reference):
    expected = reference.chat(SEA, PIPELINE_TOKENS)
    placement = {"sharding": "pipeline", "min_nodes": 2}
    stream, api, victim, instance_id, before, killed_at = _kill_mid_stream(
        cluster, nodes, chat_body(SEA, PIPELINE_TOKENS), placement, victim_rank=1)
    _finished(stream)
    assert stream.first_text_after(killed_at) is not None
    assert stream.text == expected
    replacement = _assert_healed(cluster, api, stream, instance_id, {node_id_of(victim)}, before)
    shards = state_of(api).instances[replacement].shards
    assert {s.node_id for s in shards} == {node_id_of(n) for n in nodes if n is not victim}
    wait_until(lambda: cluster.ready(replacement, api), 60, 0.3, "the replacement ready")
    assert _chat(api, AFTER, 40) == reference.chat(AFTER, 40)


def _paused_mid_stream(cluster: SharedNatsCluster, nodes: list[ExoProcess], body: dict, until, longest: float
                       ) -> tuple[Streamed, ExoProcess, str, float]:
    """SIGSTOP every process of the generating node (exo, runner, nats-server) once the stream is
    under way, until `until(api, stream)` or `longest` seconds, then SIGCONT. Returns (stream,
    api node, instance id, seconds paused)."""
    api = cluster.head
    instance_id = cluster.place(api)["instance_id"]
    host = cluster.hosts(instance_id, api)[0]
    stream = stream_chat(api.url, body)
    _mid_stream(stream)
    pids = pids_of(host)
    signal_all(pids, signal.SIGSTOP)
    stopped = time.monotonic()
    try:
        deadline = stopped + longest
        while time.monotonic() < deadline and not until(api, stream):
            time.sleep(0.05)
    finally:
        signal_all(pids, signal.SIGCONT)
    return stream, api, instance_id, time.monotonic() - stopped


def test_a_node_paused_past_the_suspect_time_loses_its_generation_and_its_late_tokens_are_not_given_twice(
        cluster, nodes, reference):
    expected = reference.chat(SEA, MAX_TOKENS)

    def moved(api: ExoProcess, stream: Streamed) -> bool:
        try:
            state = state_of(api)
            task = state.tasks[stream.task_id]
            return bool(task.migrations) and any(i.instance_id != task.migrations[0].from_instance
                                                 for i in state.instances.values())
        except (httpx.HTTPError, KeyError):
            return False

    # paused until the move and the replacement are in State (a paused master's takeover comes
    # first), not long enough to be timed out: it wakes up with its runner mid-generation and
    # sends what it had, chunks of the task's first run that the client must not get
    stream, api, instance_id, paused = _paused_mid_stream(
        cluster, nodes, chat_body(SEA, MAX_TOKENS), moved, NODE_TIMEOUT_S - 2)
    assert paused >= SUSPECT_S and moved(api, stream), f"no migration after a {paused:.1f} s pause"
    _finished(stream)
    assert stream.text == expected
    assert stream.finish_reason == "length"
    assert len(_migrations(api, stream.task_id)) == 1
    assert instance_id not in state_of(api).instances


def test_a_pause_shorter_than_the_suspect_time_moves_nothing(cluster, nodes, reference):
    expected = reference.chat(SEA, MAX_TOKENS)
    stream, api, instance_id, paused = _paused_mid_stream(
        cluster, nodes, chat_body(SEA, MAX_TOKENS), lambda api, stream: False, SUSPECT_S / 3)
    _finished(stream)
    assert stream.text == expected
    assert stream.longest_pause() >= paused * 0.8  # the stream did stop while the node was
    state = state_of(api)
    assert state.tasks[stream.task_id].migrations == [] and instance_id in state.instances


def test_with_no_room_left_the_desire_says_why_and_the_generation_waits_for_the_node_to_come_back(
        cluster, nodes, reference):
    expected = reference.chat(SEA, PIPELINE_TOKENS)
    placement = {"sharding": "pipeline", "min_nodes": 3}
    # rank 0 goes (the ranks left behind are followers: nothing of theirs reaches the client)
    stream, api, victim, instance_id, before, killed_at = _kill_mid_stream(
        cluster, nodes, chat_body(SEA, PIPELINE_TOKENS), placement, victim_rank=0)

    def waiting() -> str:
        desires = state_of(api).desires
        return next((d.waiting for d in desires.values()), "")

    reason = wait_until(waiting, 40, 0.3, "the desire waiting with its reason")
    assert "min_nodes=3" in reason, reason
    task = state_of(api).tasks[stream.task_id]
    # It waits ("" : no instance). On a loaded machine the surviving ranks may report their broken
    # ring before the dead node is suspected: a replacement on the same three nodes is placed and
    # takes the task first, then goes with the node (seen once in CI): a move before the wait.
    assert task.status != "failed" and task.migrations[-1].to_instance == "" and len(task.migrations) <= 2, task
    assert not stream.done.is_set()
    cluster.bring_back()  # room again: the desire is placed, the task goes on
    _finished(stream)
    assert stream.text == expected
    desire = next(iter(state_of(api).desires.values()))
    assert desire.waiting == "" and len(state_of(api).instances) == 1
    assert metric(api, "exo_migrations_total") >= before + 1
    assert state_of(api).tasks[stream.task_id].model_id == MODEL
