"""Prefill on one machine, decode on another: a head node (master and API) and two workers on one
real nats-server, a prefill instance on one worker and a decode instance on another (a third stands
by for the replacement). The KV cache crosses between the workers' runners over TCP; the text is
exactly mlx-lm's; a decode node killed while its cache is on its way, or mid-generation, leaves its
request to the prefill instance, which finishes it exactly (a migration)."""

from __future__ import annotations

import json
import os
import re
import signal
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from exo.core.ids import NodeId, TaskId
from tests.support.cluster import NatsServer, node_process, state_of, wait_until
from tests.support.e2e import Reference
from tests.support.exo_process import ExoProcess, runner_pids, start_all
from tests.support.healing import node_id_of
from tests.support.tiny_model import make_tiny_model
from tests.test_multinode import stop_cluster
from tests.test_prefill_split_e2e import prefill_runner_pid, prompt_of

pytestmark = pytest.mark.slow

NODE_TIMEOUT_S = 4.0
MODEL = "local/tiny"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("models") / "tiny")


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> Reference:
    return Reference(model_dir)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory,
            model_dir: Path) -> Iterator[tuple[ExoProcess, list[ExoProcess], httpx.Client]]:
    root = tmp_path_factory.mktemp("split")
    nats = NatsServer(root / "nats")
    beat = {"EXO_HEARTBEAT_S": "0.5", "EXO_ADVERTISE_ADDRESSES": "127.0.0.1"}
    head, *workers = start_all([
        node_process(root, "head", nats.url, "--no-worker", "--node-timeout", str(NODE_TIMEOUT_S), env=beat),
        *(node_process(root, f"worker{n}", nats.url, "--no-master", "--no-api", env=beat) for n in (1, 2, 3))])
    http = httpx.Client(base_url=head.url, timeout=300)
    wait_until(lambda: len(state_of(head).nodes) == 3, 30, what="the workers registered")
    assert http.post("/models/add", json={"model_id": MODEL, "path": str(model_dir)}).status_code == 200
    yield head, workers, http
    http.close()
    stop_cluster(head, [w for w in workers if w.process and w.process.poll() is None], nats)


def place(http: httpx.Client, role: str) -> str:
    placed = http.post("/place_instance", json={"model_id": MODEL, "role": role, "wait": 120})
    assert placed.status_code == 200, placed.text
    instance_id: str = placed.json()["instance_id"]
    return instance_id


@pytest.fixture(scope="module")
def split(cluster) -> tuple[str, str]:
    head, _, http = cluster
    prefill, decode = place(http, "prefill"), place(http, "decode")
    instances = state_of(head).instances
    assert instances[prefill].shards[0].node_id != instances[decode].shards[0].node_id, "both on one node"
    return prefill, decode


def ready_decode_instance(head: ExoProcess, prefill: str) -> tuple[str, NodeId]:
    """The decode instance now (self-healing replaces a killed one), once its runner is ready, and its node."""
    def ready() -> tuple[str, NodeId] | None:
        state = state_of(head)
        prefill_node = state.instances[prefill].shards[0].node_id
        return next(((i.instance_id, i.shards[0].node_id) for i in state.instances.values()
                     if i.role == "decode" and i.shards[0].node_id != prefill_node
                     and (r := state.runners.get(i.shards[0].runner_id)) is not None and r.status == "ready"), None)
    wait_until(lambda: ready() is not None, 120, what="a ready decode instance on a node of its own")
    found = ready()
    assert found is not None
    return found


def open_connections_to(port: int) -> int:
    """Established TCP connections whose local end is `port` (the prefill runner's side of an exchange)."""
    return sum(1 for table in ("/proc/net/tcp", "/proc/net/tcp6")
               for fields in (line.split() for line in Path(table).read_text().splitlines()[1:])
               if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == "01")  # ESTABLISHED


def ask(content: str, max_tokens: int, stream: bool = False) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "temperature": 0, "stream": stream}


@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "seeded"])
@pytest.mark.parametrize("length", [10, 1000, 8000])
def test_the_cache_crosses_machines_and_the_text_is_mlx_lms(cluster, split, reference, length, seeded):
    head, _, http = cluster
    prefill, decode = split
    content = prompt_of(reference, length, f"across{length}{'s' if seeded else 'g'}")
    messages = [{"role": "user", "content": content}]
    sampling = {"temperature": 0.8, "seed": 11} if seeded else {}
    answer = http.post("/v1/chat/completions", json=ask(content, 16) | sampling)
    assert answer.status_code == 200, answer.text
    reply = answer.json()
    expected = reference.sampled_chat(messages, 16, seed=11, temperature=0.8) if seeded else reference.chat(messages, 16)
    assert reply["choices"][0]["message"]["content"] == expected
    usage = reply["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"] - 1, usage
    task = state_of(head).tasks[TaskId(reply["id"].removeprefix("chatcmpl-"))]
    assert (task.instance_id, task.prefill_instance) == (decode, prefill)


def test_a_decode_node_killed_while_it_waits_for_its_cache_leaves_the_request_to_the_prefill_instance(
        cluster, split, reference):
    """The prefill runner is paused, so the kill lands while the exchange is open and nothing is sent:
    on waking, the prefill runner finds its asker gone; the master moves the request to it."""
    head, workers, http = cluster
    prefill, _ = split
    _, decode_node = ready_decode_instance(head, prefill)
    victim = next(w for w in workers if node_id_of(w) == decode_node)
    prefill_worker = next(w for w in workers if node_id_of(w) == state_of(head).instances[prefill].shards[0].node_id)
    port = int(state_of(head).runners[state_of(head).instances[prefill].shards[0].runner_id]
               .prefill_address.rpartition(":")[2])
    paused = prefill_runner_pid(head, prefill, prefill_worker)
    content = prompt_of(reference, 300, "in transfer")
    with ThreadPoolExecutor(1) as pool:
        os.kill(paused, signal.SIGSTOP)
        try:
            answer = pool.submit(http.post, "/v1/chat/completions", json=ask(content, 16))
            wait_until(lambda: open_connections_to(port) > 0 or answer.done(), 60, what="the exchange's connection")
            assert not answer.done(), answer.result().text
            assert victim.process is not None
            for pid in [*runner_pids(victim.process.pid), victim.process.pid]:  # the machine goes, runners and all
                os.kill(pid, signal.SIGKILL)
        finally:
            os.kill(paused, signal.SIGCONT)
        reply = answer.result()
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["message"]["content"] == reference.chat([{"role": "user", "content": content}], 16)
    task = state_of(head).tasks[TaskId(reply.json()["id"].removeprefix("chatcmpl-"))]
    assert (task.prefill_instance, [m.to_instance for m in task.migrations]) == (prefill, [prefill]), task
    logs = "".join(path.read_text(errors="replace") for path in prefill_worker.data_dir.rglob("runner-*.log"))
    assert re.search(r"prefill connection from .* lost|refused a prefill ask .*: the connection closed", logs), logs


def test_a_decode_node_killed_mid_generation_leaves_the_request_to_the_prefill_instance_exactly(
        cluster, split, reference):
    head, workers, http = cluster
    prefill, _ = split
    _, decode_node = ready_decode_instance(head, prefill)
    victim = next(w for w in workers if node_id_of(w) == decode_node)
    content, max_tokens = prompt_of(reference, 300, "killed"), 400
    text, task_id, killed = "", "", False
    with http.stream("POST", "/v1/chat/completions", json=ask(content, max_tokens, stream=True)) as response:
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            data = json.loads(line[6:])
            assert "error" not in data, data
            task_id = task_id or data["id"].removeprefix("chatcmpl-")
            text += (data["choices"][0]["delta"].get("content") or "") if data.get("choices") else ""
            if len(text) > 20 and not killed:
                assert victim.process is not None
                os.kill(victim.process.pid, signal.SIGKILL)  # its runners exit once their worker's pipe closes
                killed = True
    assert killed, "the stream ended before the kill"
    assert text == reference.chat([{"role": "user", "content": content}], max_tokens)
    task = state_of(head).tasks[TaskId(task_id)]
    assert [m.to_instance for m in task.migrations] == [prefill], task.migrations
