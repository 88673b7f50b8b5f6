"""Cache scopes through the whole path (docs/prompt-cache.md, "What one key can learn from another"):
a key's prompt-cache entries serve only requests of its own scope. End to end, the master gives
each task its key's scope (or the cache_scope an admin gave several keys) and the runner keys its
cache by it, so another key's repeat of a secret prompt is reported with no cached tokens; on a
multi-node instance every rank keys its entries the same way (a rank that reused another prefix
than rank 0's would raise OutOfStep and exit)."""

from __future__ import annotations

import httpx
import pytest

from exo.core.requests import ChatMessage, GenerationParams
from exo.runner.engine import Engine
from tests.support.e2e import start_exo
from tests.support.fake_hub import FakeHub
from tests.support.tiny_model import TINY_MODEL_ID, Dims, make_tiny_model
from tests.test_lockstep_batch import LAYERS, on_two_ranks_with_cache

pytestmark = pytest.mark.slow  # real inference

ADMIN = "admin-secret-for-cache-scopes"
SYSTEM = "You are a helpful assistant. Please answer the question, and keep it short & clear."
SECRET = [["system", SYSTEM], ["user", "My salary is 123,456 a year. Keep it to yourself."]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("model") / "tiny", Dims(layers=LAYERS))


def prompt_tokens(model_dir, messages: list[list[str]]) -> int:
    engine = Engine()
    engine.load(str(model_dir))
    return len(engine.encode(engine.prompt_for(GenerationParams(messages=[ChatMessage(role=r, content=c)
                                                                          for r, c in messages]))))


@pytest.mark.parametrize("sharding", ["tensor", "pipeline"])
def test_every_rank_keys_its_cache_by_the_requests_scope(model_dir, sharding):
    seeded = {"seed": 3, "temperature": 0.5}  # the single path on a multi-node instance
    requests = [
        {"messages": SECRET, "max_tokens": 8, "cache_scope": "key:alice"},
        {"messages": SECRET, "max_tokens": 8, "cache_scope": "key:bob", "after_done": 0},
        {"messages": SECRET, "max_tokens": 8, "cache_scope": "key:carol", "after_done": 1, **seeded},
        {"messages": SECRET, "max_tokens": 8, "cache_scope": "key:alice", "after_done": 2, **seeded},
        {"messages": SECRET, "max_tokens": 8, "cache_scope": "key:bob", "after_done": 3},
    ]
    _, cached = on_two_ranks_with_cache(model_dir, sharding, requests)
    whole = prompt_tokens(model_dir, SECRET)
    assert cached == [0, 0, 0, whole - 1, whole - 1]


def bearer(url: str, secret: str) -> httpx.Client:
    return httpx.Client(base_url=url, timeout=120, headers={"Authorization": f"Bearer {secret}"})


def ask(client: httpx.Client, messages: list[list[str]]) -> dict:
    answer = client.post("/v1/chat/completions", json={
        "model": TINY_MODEL_ID, "max_tokens": 4, "temperature": 0,
        "messages": [{"role": r, "content": c} for r, c in messages]})
    assert answer.status_code == 200, answer.text
    usage: dict = answer.json()["usage"]
    return {"id": answer.json()["id"].removeprefix("chatcmpl-"), "prompt": usage["prompt_tokens"],
            "cached": usage["prompt_tokens_details"]["cached_tokens"]}


def test_another_keys_guesses_find_nothing_in_the_cache_and_keys_of_one_scope_share_it(tmp_path, model_dir):
    with FakeHub({TINY_MODEL_ID: model_dir}) as hub:
        exo = start_exo(tmp_path, hub, {"EXO_API_KEYS": ADMIN})
        try:
            with bearer(exo.url, ADMIN) as admin:
                assert admin.post("/models/add", json={"model_id": TINY_MODEL_ID}).status_code == 200
                assert admin.post("/place_instance", json={"model_id": TINY_MODEL_ID, "wait": 120}).status_code == 200
                keys = {}
                for name, scope in (("alice", None), ("bob", None), ("dave", None), ("eve", None), ("team1", "team-a"),
                                    ("team2", "team-a")):
                    answer = admin.post("/keys", json={"name": name} | ({"cache_scope": scope} if scope else {}))
                    assert answer.status_code == 200, answer.text
                    assert answer.json()["key"]["cache_scope"] == (scope or "")
                    keys[name] = (answer.json()["key"]["key_id"], answer.json()["secret"])
                listed = {k["name"]: k["cache_scope"] for k in admin.get("/keys").json()["data"]}
                assert listed == {"alice": "", "bob": "", "dave": "", "eve": "", "team1": "team-a", "team2": "team-a"}
                refused = admin.patch(f"/keys/{keys['bob'][0]}", json={"cache_scope": "team a"})
                assert (refused.status_code, refused.json()["error"]["param"]) == (400, "cache_scope")
                clients = {name: bearer(exo.url, secret) for name, (_, secret) in keys.items()}
                secret = ask(clients["alice"], SECRET)
                unrelated = ask(clients["dave"], [["user", "Tell me a joke."]])
                guesses = [ask(clients["bob"], SECRET), ask(clients["eve"], [SECRET[0], ["user", "My salary is 123,"]]),
                           ask(admin, SECRET)]  # EXO_API_KEYS: no key, the scope of requests without one
                assert [g["cached"] for g in guesses] == [unrelated["cached"]] * 3 == [0] * 3
                again = ask(clients["alice"], SECRET)
                assert (secret["cached"], again["cached"]) == (0, again["prompt"] - 1)
                first, teammate = ask(clients["team1"], SECRET), ask(clients["team2"], SECRET)
                assert (first["cached"], teammate["cached"]) == (0, teammate["prompt"] - 1)
                tasks = admin.get("/state").json()["tasks"]
                scopes = [tasks[r["id"]]["params"]["cache_scope"] for r in (secret, guesses[0], guesses[2], teammate)]
                assert scopes == [f"key:{keys['alice'][0]}", f"key:{keys['bob'][0]}", "", "scope:team-a"]
        finally:
            exo.interrupt()
