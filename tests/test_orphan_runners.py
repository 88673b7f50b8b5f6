"""A node's exo process dies (kill -9) while its runner streams a chat; the runner lives on in a
session of its own, so only the exo process goes. The runner sees its stdin close: it must stop
without a final chunk of its own (a `cancelled` one would end the client's stream) and exit, and
the task moves to the desire's other replica, so the client's text equals mlx-lm's exactly.

One nats-server of the test's own, a head node (master and API) and two worker nodes."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from exo.core.state import State
from tests.support.e2e import Reference
from tests.support.exo_process import ExoProcess, runner_pids
from tests.support.healing import SharedNatsCluster, chat_body, kill_9, state_of, stream_chat, wait_until
from tests.support.tiny_model import Dims, make_tiny_model

pytestmark = pytest.mark.slow

MAX_TOKENS = 1000  # ~3 s of decoding on CPU: long enough to be cut well inside
SEA = [{"role": "user", "content": "tell me about the sea"}]
CUT_AFTER_CHUNKS = 20  # text chunks the client has read when the node's exo process goes
RUNNERS_GONE_S = 10.0  # an orphaned runner has exited by then


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("model") / "tiny4", Dims(layers=4))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, model_dir) -> Iterator[SharedNatsCluster]:
    cluster = SharedNatsCluster(tmp_path_factory.mktemp("orphans"), model_dir, count=2)
    try:
        yield cluster.start()
    finally:
        cluster.stop()


def _runner_pids(node: ExoProcess) -> set[int]:
    """The node's runners: children of its exo process (each leads a session of its own)."""
    assert node.process is not None
    return set(runner_pids(node.process.pid))


def _running(pid: int) -> bool:
    """Not exited: a zombie (reaped by nobody in a container without an init) counts as exited."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _serving_node(cluster: SharedNatsCluster, state: State, task_id: str) -> ExoProcess:
    instance = state.instances[state.tasks[task_id].instance_id]
    assert len(instance.shards) == 1, instance
    return cluster.by_id(instance.shards[0].node_id)


def test_a_node_s_exo_process_killed_alone_leaves_no_runner_and_its_stream_goes_on_exact(cluster, model_dir):
    expected = Reference(model_dir).chat(SEA, MAX_TOKENS)
    placed = cluster.place(cluster.head, replicas=2)
    desire_id = placed["instance"]["desire_id"]
    wait_until(lambda: sum(cluster.ready(i.instance_id, cluster.head) for i in state_of(cluster.head).instances.values()
                           if i.desire_id == desire_id) == 2, 120, 0.3, "both replicas ready")

    stream = stream_chat(cluster.head.url, chat_body(SEA, MAX_TOKENS))
    wait_until(lambda: stream.text_chunks() >= CUT_AFTER_CHUNKS or stream.done.is_set(), 60, 0.005,
               "the stream under way")
    assert not stream.done.is_set(), "the stream ended before the node could be stopped"
    victim = _serving_node(cluster, state_of(cluster.head), stream.task_id)
    runners = _runner_pids(victim)
    assert runners, "the serving node has no runner process"
    assert victim.process is not None
    victim.process.kill()  # its exo process only: the runners, in sessions of their own, stay
    victim.process.wait()
    killed_at = time.monotonic()
    try:
        assert stream.done.wait(90), f"the stream did not end ({len(stream.text)} chars so far)"
        assert stream.status == 200 and not stream.errors, (stream.status, stream.errors)
        assert stream.first_text_after(killed_at) is not None  # cut inside, not after the end
        assert stream.text == expected
        assert stream.finish_reason == "length"
        assert len(state_of(cluster.head).tasks[stream.task_id].migrations) == 1
        left = {pid for pid in runners if _running(pid)}
        while left and time.monotonic() < killed_at + RUNNERS_GONE_S:
            time.sleep(0.1)
            left = {pid for pid in left if _running(pid)}
        assert not left, f"runners of the dead node still running {RUNNERS_GONE_S:g} s after: {left}"
    finally:
        kill_9(victim)  # its log closed, and nothing of it left whatever the outcome
        for pid in filter(_running, runners):
            os.kill(pid, signal.SIGKILL)
