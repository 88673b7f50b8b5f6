"""Placement knows the size of the models people add (issue 28): a card added by path or by Hub
id gets `storage_bytes` from its weights, a model that does not fit is refused with the numbers
in human units, and only `"force": true` places it anyway. Adding by Hub id names the Hub's
failure: 503 when it cannot be reached (at once), 424 in offline mode, 404 only when it says so."""

from __future__ import annotations

import shutil
import socket
import time
from pathlib import Path

import httpx
import pytest

from exo.core.placement import human_bytes
from exo.memory import memory
from tests.support.e2e import start_exo
from tests.support.fake_hub import FakeHub
from tests.support.tiny_model import make_tiny_model

HUGE = max(50 * 10**9, 2 * memory()[0]) // 10**9 * 10**9  # more than this machine has, in whole GB
TINY_ID = "exo-test/tiny-sized"
HUGE_HUB_ID = "exo-test/huge-listed"


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("models") / "tiny")


@pytest.fixture(scope="module")
def huge_dir(tmp_path_factory, tiny_dir) -> Path:
    """The tiny model's config and tokenizer beside a sparse 50 GB weights file (no disk used)."""
    path = tmp_path_factory.mktemp("models") / "huge"
    shutil.copytree(tiny_dir, path, ignore=shutil.ignore_patterns("*.safetensors"))
    with open(path / "model.safetensors", "wb") as weights:
        weights.truncate(HUGE)
    return path


@pytest.fixture(scope="module")
def hub(tiny_dir):
    with FakeHub({TINY_ID: tiny_dir, HUGE_HUB_ID: tiny_dir}) as fake:
        fake.listed_sizes[f"{HUGE_HUB_ID}/model.safetensors"] = HUGE  # listed huge, as a big repo is
        yield fake


def weights_bytes(model_dir: Path) -> int:
    return sum(p.stat().st_size for p in model_dir.glob("*.safetensors"))


def refused_for_size(http: httpx.Client, model_id: str) -> str:
    refused = http.post("/place_instance", json={"model_id": model_id})
    assert refused.status_code == 409, refused.text
    message = refused.json()["error"]["message"]
    assert message.startswith(f"{model_id} needs {human_bytes(HUGE)}; the node with the most free memory (")
    assert " GB free) cannot hold it" in message and "bytes" not in message  # people's units
    previews = http.get("/instance/previews", params={"model_id": model_id}).json()["previews"]
    assert [p["instance"] for p in previews] == [None] * len(previews)
    return message


def forced(http: httpx.Client, model_id: str) -> None:
    placed = http.post("/place_instance", json={"model_id": model_id, "force": True})
    assert placed.status_code == 200, placed.text
    assert http.delete(f"/instance/{placed.json()['instance_id']}").status_code == 200


def test_a_model_added_by_path_carries_the_size_of_its_weights(http, huge_dir, node):
    added = http.post("/models/add", json={"model_id": "local/huge", "path": str(huge_dir)})
    assert added.status_code == 200, added.text
    assert added.json()["card"]["storage_bytes"] == HUGE
    message = refused_for_size(http, "local/huge")
    assert node.name_shown in message  # the node by its name, not its id
    forced(http, "local/huge")


def test_a_model_added_by_hub_id_carries_the_size_its_listing_gives(http, tiny_dir):
    added = http.post("/models/add", json={"model_id": TINY_ID})
    assert added.status_code == 200, added.text
    assert added.json()["card"]["storage_bytes"] == weights_bytes(tiny_dir) > 0
    preview = http.get("/instance/previews", params={"model_id": TINY_ID}).json()["previews"][0]
    assert preview["instance"] is not None
    assert preview["ranks"][0]["weights_bytes"] == weights_bytes(tiny_dir)
    assert preview["ranks"][0]["kv_bytes"] > 0 and preview["ranks"][0]["max_context"] > 0
    huge = http.post("/models/add", json={"model_id": HUGE_HUB_ID})
    assert huge.status_code == 200 and huge.json()["card"]["storage_bytes"] == HUGE
    refused_for_size(http, HUGE_HUB_ID)
    forced(http, HUGE_HUB_ID)


def test_a_card_of_unknown_size_is_refused_unless_forced(http):
    assert http.post("/models/add", json={"model_id": "org/unsized", "n_layers": 2}).status_code == 200
    refused = http.post("/place_instance", json={"model_id": "org/unsized"})
    assert refused.status_code == 409
    assert "the size of org/unsized is unknown" in refused.json()["error"]["message"]
    assert '"force": true' in refused.json()["error"]["message"]


@pytest.fixture(scope="module")
def node(tmp_path_factory, hub):
    exo = start_exo(tmp_path_factory.mktemp("node"), hub)
    assert httpx.post(f"{exo.url}/models/add", json={"model_id": TINY_ID}, timeout=60).status_code == 200
    shown = httpx.get(f"{exo.url}/state").json()["nodes"][exo_node_id(exo)]
    exo.name_shown = shown.get("name") or shown["hostname"]
    yield exo
    exo.interrupt()


def exo_node_id(exo) -> str:
    return httpx.get(f"{exo.url}/node_id").json()


def closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.slow
def test_an_unreachable_hub_is_a_503_at_once_and_offline_is_a_424(tmp_path):
    class Nowhere:  # a Hub endpoint nothing listens on
        endpoint = f"http://127.0.0.1:{closed_port()}"

    for env, status, words in ((None, 503, "cannot reach the model hub (http://127.0.0.1:"),
                               ({"EXO_OFFLINE": "1"}, 424, "offline mode: mlx-community/SmolLM2-135M-Instruct is "
                                                           "not on this node")):
        (tmp_path / str(status)).mkdir()
        exo = start_exo(tmp_path / str(status), Nowhere, env)  # type: ignore[arg-type]
        try:
            started = time.monotonic()
            answer = httpx.post(f"{exo.url}/models/add", json={"model_id": "mlx-community/SmolLM2-135M-Instruct"},
                                timeout=60)
            assert time.monotonic() - started < 5
            assert answer.status_code == status, answer.text
            assert words in answer.json()["error"]["message"]
        finally:
            exo.interrupt()


def test_mistakes_get_the_fix_in_the_answer(http):
    wrong_field = http.post("/place_instance", json={"model": TINY_ID})
    assert wrong_field.status_code == 400
    assert wrong_field.json()["error"]["message"].endswith("unknown field `model`; did you mean `model_id`?")
    typo = http.post("/place_instance", json={"model_id": TINY_ID.upper()})
    assert typo.status_code == 404 and f"did you mean {TINY_ID!r}?" in typo.json()["error"]["message"]
    chat = http.post("/v1/chat/completions", json={"model": "exo-test/tiny-sizd", "messages": [{"role": "user",
                                                                                               "content": "hi"}]})
    assert chat.status_code == 404 and f"did you mean {TINY_ID!r}?" in chat.json()["error"]["message"]
    bare = http.post("/models/add", json={"model_id": "SmolLM2"})
    assert bare.status_code == 400 and "must look like 'org/name'" in bare.json()["error"]["message"]
    twice = http.post("/models/add", json={"model_id": TINY_ID.upper(), "n_layers": 2})
    assert twice.status_code == 409 and f"already known as {TINY_ID!r}" in twice.json()["error"]["message"]


def test_a_retried_placement_with_an_idempotency_key_returns_the_same_instance(http):
    key = {"Idempotency-Key": "retry-me-0001"}
    first = http.post("/place_instance", json={"model_id": TINY_ID}, headers=key)
    assert first.status_code == 200, first.text
    again = http.post("/place_instance", json={"model_id": TINY_ID, "wait": 60}, headers=key)  # the retry of a 202
    assert again.status_code == 200, again.text
    assert again.json()["instance_id"] == first.json()["instance_id"] and again.json()["status"] == "ready"
    instances = [i for i in http.get("/state").json()["instances"].values() if i["model_id"] == TINY_ID]
    assert len(instances) == 1  # not placed (nor its memory reserved) twice
    other = http.post("/place_instance", json={"model_id": HUGE_HUB_ID}, headers=key)
    assert other.status_code == 422 and other.json()["error"]["code"] == "idempotency_key_reused"
    assert http.delete(f"/instance/{first.json()['instance_id']}").status_code == 200
    gone = http.post("/place_instance", json={"model_id": TINY_ID}, headers=key)
    assert gone.status_code == 409 and gone.json()["error"]["code"] == "idempotency_key_used"
    assert http.post("/place_instance", json={"model_id": TINY_ID}, headers={"Idempotency-Key": "a b"}).status_code == 400
