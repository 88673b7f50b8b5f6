"""A LoRA adapter on an instance across two worker processes (tensor and pipeline): the workers
join after the adapter was added, fetch its weights by hash before their runners load, and the
text equals mlx-lm's in one process with the adapter loaded, token for token."""

from __future__ import annotations

import hashlib
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.support.adapters import make_adapter
from tests.support.cluster import NatsServer, node_process, start_node, state_of, wait_until
from tests.support.e2e import Reference
from tests.support.exo_process import start_all
from tests.support.tiny_model import Dims, make_tiny_model
from tests.test_adapters import upload
from tests.test_multinode import PROMPT, _ring_ports, stop_cluster

pytestmark = pytest.mark.slow

MODEL = "local/tiny4"
ADAPTED = f"{MODEL}:pirate"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("models") / "tiny4", Dims(layers=4))


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory, model_dir):
    return make_adapter(model_dir, tmp_path_factory.mktemp("adapter") / "pirate")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, model_dir, adapter_dir):
    root = tmp_path_factory.mktemp("adapters-multinode")
    nats = NatsServer(root / "nats")
    beat = {"EXO_HEARTBEAT_S": "0.5", "EXO_ADVERTISE_ADDRESSES": "127.0.0.1"}
    head = start_node(root, "head", nats.url, "--no-worker", env=beat)
    http = httpx.Client(base_url=head.url, timeout=120)
    assert http.post("/models/add", json={"model_id": MODEL, "path": str(model_dir)}).status_code == 200
    files = {"config": (adapter_dir / "adapter_config.json").read_bytes(),
             "weights": (adapter_dir / "adapters.safetensors").read_bytes()}
    added = http.post("/adapters", data={"name": "pirate", "base_model": MODEL}, files=files)
    assert added.status_code == 200, added.text
    # The workers join later: the adapter is in State (and its weights in exo-adapters) before they exist.
    workers = start_all([
        node_process(root, f"worker{n}", nats.url, "--no-master", "--no-api", env=beat | {"EXO_RING_PORTS": _ring_ports()})
        for n in (1, 2)
    ])
    wait_until(lambda: len(state_of(head).nodes) == 2, 30, what="both workers registered")
    yield head, workers, http, added.json()["adapter"]["digest"]
    http.close()
    stop_cluster(head, workers, nats)


@pytest.mark.parametrize("sharding", ["tensor", "pipeline"])
def test_two_late_joiners_fetch_the_adapter_by_hash_and_generate_what_mlx_lm_does(cluster, model_dir, adapter_dir,
                                                                                  sharding):
    head, workers, http, digest = cluster
    placed = http.post("/place_instance", json={"model_id": ADAPTED, "sharding": sharding, "min_nodes": 2, "wait": 120})
    assert placed.status_code == 200, placed.text
    instance = state_of(head).instances[placed.json()["instance_id"]]
    assert len({s.node_id for s in instance.shards}) == 2
    for worker in workers:  # each fetched the weights and verified them against the hash
        cached = worker.data_dir / "adapters" / "weights" / digest
        assert hashlib.sha256(cached.read_bytes()).hexdigest() == digest
    expected = Reference(model_dir, adapter_dir).chat(PROMPT, 24)
    assert expected != Reference(model_dir).chat(PROMPT, 24)
    answer = http.post("/v1/chat/completions", json={"model": ADAPTED, "messages": PROMPT, "max_tokens": 24,
                                                     "temperature": 0})
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["message"]["content"] == expected
    for instance_id in list(state_of(head).instances):
        assert http.delete(f"/instance/{instance_id}").status_code == 200
    wait_until(lambda: not state_of(head).runners, 30, what="runners gone")


def test_the_bare_bases_two_rank_instance_serves_its_adapters_per_row_fetched_by_hash_on_every_rank(
        cluster, model_dir, adapter_dir, tmp_path):
    """EXO_ADAPTERS_SHARE_BASE (the default) on a pipeline instance of the base: rank 1's runner
    fetches each adapter from exo-adapters by the hash rank 0 names (tests/test_adapters_on_ranks.py)."""
    head, _, http, _ = cluster
    poet = make_adapter(model_dir, tmp_path / "poet", seed=11, rank=8)
    assert upload(http, "poet", poet, base=MODEL).status_code == 200
    placed = http.post("/place_instance", json={"model_id": MODEL, "sharding": "pipeline", "min_nodes": 2, "wait": 120})
    assert placed.status_code == 200, placed.text
    rows = {MODEL: Reference(model_dir), ADAPTED: Reference(model_dir, adapter_dir), f"{MODEL}:poet": Reference(model_dir, poet)}

    def ask(model: str) -> str:
        answer = http.post("/v1/chat/completions", json={"model": model, "messages": PROMPT, "max_tokens": 24,
                                                         "temperature": 0})
        assert answer.status_code == 200, answer.text
        return str(answer.json()["choices"][0]["message"]["content"])

    with ThreadPoolExecutor(len(rows)) as pool:
        answers = list(pool.map(ask, rows))
    assert answers == [reference.chat(PROMPT, 24) for reference in rows.values()]
    assert [i.model_id for i in state_of(head).instances.values()] == [MODEL]  # no instance for the adapters
    assert http.delete(f"/instance/{placed.json()['instance_id']}").status_code == 200
    wait_until(lambda: not state_of(head).runners, 30, what="runners gone")
