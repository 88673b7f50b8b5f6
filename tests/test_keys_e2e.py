"""API keys through real nodes: an admin (EXO_API_KEYS) adds keys at runtime; the official
`openai` and `anthropic` clients see the rate-limit headers and 429s with Retry-After; scopes
refuse models and admin routes; a deleted key stops working on every API node within a second;
two API nodes together admit a key's limit and not one request more; keys survive a restart;
GET /usage equals the usage a replay of the log computes."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import anthropic
import httpx
import openai
import pytest

from tests.support.cluster import NatsServer, replay, start_node, wait_until
from tests.support.e2e import start_exo
from tests.support.fake_hub import FakeHub
from tests.support.tiny_model import TINY_MODEL_ID, make_tiny_model

pytestmark = pytest.mark.slow

ADMIN = "admin-secret-for-tests"
ASK = [{"role": "user", "content": "Hello"}]
OTHER = "local/other"


def admin_client(url: str) -> httpx.Client:
    return httpx.Client(base_url=url, timeout=120, headers={"Authorization": f"Bearer {ADMIN}"})


def add_key(admin: httpx.Client, **fields) -> tuple[str, str]:
    answer = admin.post("/keys", json=fields)
    assert answer.status_code == 200, answer.text
    return answer.json()["key"]["key_id"], answer.json()["secret"]


def chat(url: str, secret: str, model: str = TINY_MODEL_ID) -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions", headers={"Authorization": f"Bearer {secret}"}, timeout=120,
                      json={"model": model, "messages": ASK, "max_tokens": 2, "temperature": 0})


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("model") / "tiny")


@pytest.fixture(scope="module")
def node(tmp_path_factory, model_dir):
    root = tmp_path_factory.mktemp("keys")
    with FakeHub({TINY_MODEL_ID: model_dir}) as hub:
        exo = start_exo(root, hub, {"EXO_API_KEYS": ADMIN})
        with admin_client(exo.url) as admin:
            assert admin.post("/models/add", json={"model_id": TINY_MODEL_ID}).status_code == 200
            assert admin.post("/models/add", json={"model_id": OTHER, "path": str(model_dir)}).status_code == 200
            for model in (TINY_MODEL_ID, OTHER):
                assert admin.post("/place_instance", json={"model_id": model, "wait": 120}).status_code == 200
        yield exo
        exo.interrupt()


def test_a_key_added_at_runtime_is_scoped_limited_and_its_clients_see_the_headers(node):
    exo = node
    with admin_client(exo.url) as admin:
        key_id, secret = add_key(admin, name="agent", models=[TINY_MODEL_ID], limits={"requests_per_minute": 3})
        listed = admin.get("/keys").json()["data"]
        assert [k["key_id"] for k in listed] == [key_id] and "secret_sha256" not in listed[0]
        assert secret not in admin.get("/state").text  # State holds the hash only
    client = openai.OpenAI(base_url=f"{exo.url}/v1", api_key=secret, max_retries=0)
    raw = client.chat.completions.with_raw_response.create(model=TINY_MODEL_ID, messages=ASK, max_tokens=2)
    assert (raw.headers["x-ratelimit-limit-requests"], raw.headers["x-ratelimit-remaining-requests"]) == ("3", "2")
    assert [m.id for m in client.models.list().data] == [TINY_MODEL_ID]  # what it may use
    with pytest.raises(openai.PermissionDeniedError, match="may not use the model"):
        client.chat.completions.create(model=OTHER, messages=ASK, max_tokens=2)
    for path in ("/keys", "/place_instance", "/state"):
        answer = httpx.request("GET" if path != "/place_instance" else "POST", f"{exo.url}{path}", json={},
                               headers={"Authorization": f"Bearer {secret}"})
        assert answer.status_code == 403 and "needs an admin key" in answer.text, (path, answer.text)
    client.chat.completions.create(model=TINY_MODEL_ID, messages=ASK, max_tokens=2)
    client.chat.completions.create(model=TINY_MODEL_ID, messages=ASK, max_tokens=2)
    with pytest.raises(openai.RateLimitError) as limited:
        client.chat.completions.create(model=TINY_MODEL_ID, messages=ASK, max_tokens=2)
    headers = limited.value.response.headers
    assert 1 <= int(headers["Retry-After"]) <= 60 and headers["x-ratelimit-remaining-requests"] == "0"
    assert "made 3 requests in the last minute" in limited.value.message


def test_anthropic_clients_see_their_headers_and_a_deleted_key_fails_within_a_second(node):
    exo = node
    with admin_client(exo.url) as admin:
        key_id, secret = add_key(admin, limits={"requests_per_minute": 5, "tokens_per_minute": 1000})
        claude = anthropic.Anthropic(base_url=exo.url, api_key=secret, max_retries=0)
        raw = claude.messages.with_raw_response.create(model=TINY_MODEL_ID, max_tokens=2, messages=ASK)
        assert raw.headers["anthropic-ratelimit-requests-limit"] == "5"
        assert raw.headers["anthropic-ratelimit-requests-remaining"] == "4"
        assert raw.headers["anthropic-ratelimit-tokens-limit"] == "1000"
        assert raw.headers["anthropic-ratelimit-requests-reset"].endswith("Z")
        for _ in range(4):
            claude.messages.create(model=TINY_MODEL_ID, max_tokens=2, messages=ASK)
        with pytest.raises(anthropic.RateLimitError, match="made 5 requests in the last minute") as limited:
            claude.messages.create(model=TINY_MODEL_ID, max_tokens=2, messages=ASK)
        assert 1 <= int(limited.value.response.headers["retry-after"]) <= 60
        assert limited.value.response.headers["anthropic-ratelimit-requests-remaining"] == "0"
        assert admin.delete(f"/keys/{key_id}").status_code == 200
        deleted = time.monotonic()
    wait_until(lambda: chat(exo.url, secret).status_code == 401, 1.0, interval=0.02, what="the deleted key refused")
    assert time.monotonic() - deleted < 1.0


def test_usage_equals_a_replay_of_the_log_and_keys_survive_a_restart(node):
    exo = node
    with admin_client(exo.url) as admin:
        key_id, secret = add_key(admin, name="survivor")
        for _ in range(2):
            assert chat(exo.url, secret).status_code == 200
        wait_until(lambda: admin.get(f"/usage?key_id={key_id}").json()["data"][0]["completion_tokens"] == 4, 10,
                   what="both requests' tokens counted")
        rows = admin.get("/usage").json()["data"]
        mine = httpx.get(f"{exo.url}/usage", headers={"Authorization": f"Bearer {secret}"}).json()["data"]
        assert mine == [r for r in rows if r["key_id"] == key_id] and len(mine) == 1 and mine[0]["requests"] == 2
        assert f'exo_key_requests_total{{key_id="{key_id}",model_id="{TINY_MODEL_ID}"}} 2.0' in admin.get("/metrics").text
        last = int(admin.get("/state").json()["last_seq"])
    folded, _ = replay(exo.nats_url(), last)
    recomputed = [{"key_id": k, "day": d, "model": m, "requests": c.requests, "prompt_tokens": c.prompt_tokens,
                   "completion_tokens": c.completion_tokens, "cached_tokens": c.cached_tokens}
                  for k, days in sorted(folded.usage.items()) for d, models in sorted(days.items())
                  for m, c in sorted(models.items())]
    assert recomputed == rows
    exo.interrupt()
    exo.start()  # the same data dir: its NATS store holds the log and the keys
    models = httpx.get(f"{exo.url}/v1/models", headers={"Authorization": f"Bearer {secret}"})
    assert models.status_code == 200, models.text
    assert chat(exo.url, "exo-not-a-key").status_code == 401


def test_two_api_nodes_admit_a_keys_limit_and_not_one_request_more(tmp_path, model_dir):
    nats = NatsServer(tmp_path / "nats")
    env = {"EXO_API_KEYS": ADMIN, "EXO_HEARTBEAT_S": "0.5"}
    head = start_node(tmp_path, "head", nats.url, env=env)
    second = start_node(tmp_path, "api2", nats.url, "--no-master", "--no-worker", env=env)
    try:
        with admin_client(head.url) as admin:
            assert admin.post("/models/add", json={"model_id": TINY_MODEL_ID, "path": str(model_dir)}).status_code == 200
            placed = admin.post("/place_instance", json={"model_id": TINY_MODEL_ID, "wait": 120, "max_queue": 200})
            assert placed.status_code == 200, placed.text
            key_id, secret = add_key(admin, limits={"requests_per_minute": 10})
        urls = [head.url, second.url] * 15
        wait_until(lambda: chat(second.url, "exo-not-a-key").status_code == 401, 10, what="the second node keyed")
        with ThreadPoolExecutor(8) as pool:
            statuses = list(pool.map(lambda url: chat(url, secret).status_code, urls))
        assert statuses.count(200) == 10 and statuses.count(429) == 20, statuses  # overshoot: none
        with admin_client(head.url) as admin:
            assert admin.delete(f"/keys/{key_id}").status_code == 200
        deleted = time.monotonic()
        for url in (head.url, second.url):
            wait_until(lambda url=url: chat(url, secret).status_code == 401, 1.0, interval=0.02, what=f"{url} refuses")
        assert time.monotonic() - deleted < 1.0
    finally:
        for process in (second, head):
            process.interrupt()
        nats.stop()


def _first_token_at(url: str, secret: str, max_tokens: int) -> float:
    body = {"model": TINY_MODEL_ID, "messages": ASK, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    first = 0.0
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=300,
                      headers={"Authorization": f"Bearer {secret}"}) as stream:
        assert stream.status_code == 200, stream.read()
        for line in stream.iter_lines():
            if not first and line.startswith("data: {") and json.loads(line[6:])["choices"][0]["delta"].get("content"):
                first = time.monotonic()
    return first


def test_one_keys_flood_does_not_starve_another_keys_request(tmp_path, model_dir):
    """Batch of 2: key A's 10 long requests queue behind 2 running; key B's one, asked after them,
    starts when the first slot frees, before A's third (first in, first out would make it 11th)."""
    with FakeHub({TINY_MODEL_ID: model_dir}) as hub:
        exo = start_exo(tmp_path, hub, {"EXO_API_KEYS": ADMIN, "EXO_MAX_BATCH": "2"})
        try:
            with admin_client(exo.url) as admin:
                assert admin.post("/models/add", json={"model_id": TINY_MODEL_ID}).status_code == 200
                placed = admin.post("/place_instance", json={"model_id": TINY_MODEL_ID, "wait": 120})
                assert placed.status_code == 200, placed.text
                _, flood_key = add_key(admin, name="flood")
                _, lone_key = add_key(admin, name="lone")
            with ThreadPoolExecutor(11) as pool:
                flood = [pool.submit(_first_token_at, exo.url, flood_key, 800) for _ in range(10)]
                time.sleep(0.5)  # all ten are admitted and queued before the lone one is asked
                lone = pool.submit(_first_token_at, exo.url, lone_key, 5)
                firsts = sorted(f.result() for f in flood)
                lone_first = lone.result()
            assert lone_first < firsts[2], (lone_first, firsts)
        finally:
            exo.interrupt()


def test_a_request_may_ask_for_the_batch_tier_but_not_above_its_keys(node):
    exo = node
    with admin_client(exo.url) as admin:
        _, batch_secret = add_key(admin, priority="batch")
        asks = [(ADMIN, {"service_tier": "flex"}, "batch"), (ADMIN, {"priority": 5}, "batch"), (ADMIN, {}, "interactive"),
                (batch_secret, {"service_tier": "priority"}, "batch")]
        for secret, extra, tier in asks:
            answer = httpx.post(f"{exo.url}/v1/chat/completions", headers={"Authorization": f"Bearer {secret}"},
                                json={"model": TINY_MODEL_ID, "messages": ASK, "max_tokens": 2, **extra}, timeout=60)
            assert answer.status_code == 200, answer.text
            task = admin.get("/state").json()["tasks"][answer.json()["id"].removeprefix("chatcmpl-")]
            assert task["priority"] == tier, (extra, task["priority"])


def test_a_stream_that_crosses_its_token_limit_finishes_and_the_next_request_waits(node):
    exo = node
    with admin_client(exo.url) as admin:
        _, secret = add_key(admin, limits={"tokens_per_minute": 30})
    if time.time() % 60 > 50:  # the stream and the next request in one clock minute, the window tokens count in
        time.sleep(60.5 - time.time() % 60)
    client = openai.OpenAI(base_url=f"{exo.url}/v1", api_key=secret, max_retries=0)
    stream = client.chat.completions.create(model=TINY_MODEL_ID, messages=ASK, max_tokens=60, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 60  # past 30, and let finish
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    with pytest.raises(openai.RateLimitError, match="tokens this minute, its limit of 30"):
        wait_until(lambda: client.chat.completions.create(model=TINY_MODEL_ID, messages=ASK, max_tokens=2) and False,
                   5, what="the next request refused")
