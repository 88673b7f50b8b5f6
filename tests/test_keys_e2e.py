"""API keys through real nodes: an admin (EXO_API_KEYS) adds keys at runtime; the official
`openai` and `anthropic` clients see the rate-limit headers and 429s with Retry-After; scopes
refuse models and admin routes; a deleted key stops working on every API node within a second;
two API nodes together admit a key's limit and not one request more; keys survive a restart;
GET /usage equals the usage a replay of the log computes; a generation cancelled (POST /v1/cancel,
or its client hanging up) frees its key's concurrent-request slot."""

from __future__ import annotations

import json
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import anthropic
import httpx
import openai
import pytest

from tests.support.api_keys import ADMIN, add_key, admin_client
from tests.support.cluster import NatsServer, node_process, replay, wait_until
from tests.support.e2e import start_exo
from tests.support.exo_process import interrupt_all, start_all
from tests.support.fake_hub import FakeHub
from tests.support.tiny_model import TINY_MODEL_ID, make_tiny_model

pytestmark = pytest.mark.slow

ASK = [{"role": "user", "content": "Hello"}]
OTHER = "local/other"


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


def usage_rows(client: httpx.Client, key_id: str) -> list[dict]:
    return [r for r in client.get("/usage").json()["data"] if r["key_id"] == key_id]


def test_a_key_reads_its_own_usage_only(node):
    exo = node
    with admin_client(exo.url) as admin:
        key_id, secret = add_key(admin, name="reader")
        other_id, other_secret = add_key(admin, name="bystander")
        for asker in (secret, other_secret):
            assert chat(exo.url, asker).status_code == 200
        wait_until(lambda: all([r["completion_tokens"] for r in usage_rows(admin, k)] == [2] for k in (key_id, other_id)),
                   10, what="both keys' tokens counted")
        theirs = usage_rows(admin, other_id)
    with httpx.Client(base_url=exo.url, headers={"Authorization": f"Bearer {secret}"}) as reader:
        mine = reader.get("/usage").json()["data"]
        assert [(r["key_id"], r["requests"], r["completion_tokens"]) for r in mine] == [(key_id, 1, 2)]
        assert reader.get(f"/usage?key_id={key_id}").json()["data"] == mine
        refused = reader.get(f"/usage?key_id={other_id}")
    assert refused.status_code == 403, refused.text
    error = refused.json()["error"]
    assert (error["message"], error["param"], error["code"]) == ("a key may read its own usage only", "key_id",
                                                                 "permission_denied")
    with admin_client(exo.url) as admin:
        assert admin.get(f"/usage?key_id={other_id}").json()["data"] == theirs != []


def test_usage_equals_a_replay_of_the_log_and_keys_survive_a_restart(node):
    exo = node
    with admin_client(exo.url) as admin:
        key_id, secret = add_key(admin, name="survivor")
        other_id, other_secret = add_key(admin, name="bystander")  # usage the survivor must not see
        assert chat(exo.url, other_secret).status_code == 200
        for _ in range(2):
            assert chat(exo.url, secret).status_code == 200
        wait_until(lambda: [r["completion_tokens"] for r in usage_rows(admin, key_id)] == [4]
                   and [r["completion_tokens"] for r in usage_rows(admin, other_id)] == [2], 10,
                   what="every request's tokens counted")
        rows = admin.get("/usage").json()["data"]
        mine = httpx.get(f"{exo.url}/usage", headers={"Authorization": f"Bearer {secret}"}).json()["data"]
        assert mine == [r for r in rows if r["key_id"] == key_id] and len(mine) == 1 and mine[0]["requests"] == 2
        assert f'exo_key_requests_total{{key_id="{key_id}",model_id="{TINY_MODEL_ID}"}} 2.0' in admin.get("/metrics").text
        last = int(admin.get("/state").json()["last_seq"])
    folded, _ = replay(exo.nats_url(), last)
    recomputed = [{"key_id": k, "day": d, "model": m, "requests": c.requests, "prompt_tokens": c.prompt_tokens,
                   "completion_tokens": c.completion_tokens, "cached_tokens": c.cached_tokens,
                   "audio_seconds": c.audio_seconds}
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
    head, second = start_all([node_process(tmp_path, "head", nats.url, env=env),
                              node_process(tmp_path, "api2", nats.url, "--no-master", "--no-worker", env=env)])
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
        interrupt_all([second, head])
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
    starts when the first slots free, before A's fourth (first in, first out would make it 11th).
    A's first two end at the same step, so B's and A's third start together: which first token
    the client sees first is a matter of microseconds, not of the queue."""
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
            assert lone_first < firsts[3], (lone_first, firsts)
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


def test_a_request_whose_reserved_tokens_no_longer_fit_the_minute_waits_for_the_next(node):
    exo = node
    with admin_client(exo.url) as admin:
        key_id, secret = add_key(admin, limits={"tokens_per_minute": 150})  # a chat of max_tokens 60 reserves 137
    if time.time() % 60 > 50:  # the stream and the next request in one clock minute, the window tokens count in
        time.sleep(60.5 - time.time() % 60)
    client = openai.OpenAI(base_url=f"{exo.url}/v1", api_key=secret, max_retries=0)
    stream = client.chat.completions.create(model=TINY_MODEL_ID, messages=ASK, max_tokens=60, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 60
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    used = chunks[-1].usage.total_tokens
    with admin_client(exo.url) as admin:  # its reservation released, its tokens counted
        wait_until(lambda: [r["completion_tokens"] for r in usage_rows(admin, key_id)] == [60], 5, what="tokens counted")
    with pytest.raises(openai.RateLimitError, match=f"has {150 - used} tokens left this minute of its limit of 150, "
                                                    "and this request reserves 137"):
        client.chat.completions.create(model=TINY_MODEL_ID, messages=ASK, max_tokens=60)


def _running_tasks_of(admin: httpx.Client, key_id: str) -> list[dict]:
    return [t for t in admin.get("/state").json()["tasks"].values() if t["key_id"] == key_id and t["status"] == "running"]


def test_a_non_streaming_client_that_hangs_up_cancels_its_generation_and_frees_its_slot(node):
    exo = node
    with admin_client(exo.url) as admin:
        key_id, secret = add_key(admin, limits={"concurrent_requests": 1})
        body = json.dumps({"model": TINY_MODEL_ID, "messages": ASK, "max_tokens": 30_000}).encode()  # half a minute
        host, port = httpx.URL(exo.url).host, httpx.URL(exo.url).port
        with socket.create_connection((host, port)) as client:  # a raw client, to hang up mid-request
            client.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: exo\r\nContent-Type: application/json\r\n"
                           b"Authorization: Bearer " + secret.encode() + b"\r\n"
                           b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
            [task] = wait_until(lambda: _running_tasks_of(admin, key_id), 30, what="the generation running")
            assert chat(exo.url, secret).status_code == 429  # the slot is taken while it runs
        wait_until(lambda: admin.get("/state").json()["tasks"][task["task_id"]]["status"] == "cancelled", 5,
                   what="the generation cancelled")  # it had about half a minute to go
    assert chat(exo.url, secret).status_code == 200


def test_a_cancelled_stream_frees_its_keys_concurrency_slot(node):
    exo = node
    with admin_client(exo.url) as admin:
        _, secret = add_key(admin, limits={"concurrent_requests": 1})
    auth = {"Authorization": f"Bearer {secret}"}
    body = {"model": TINY_MODEL_ID, "messages": ASK, "max_tokens": 30_000, "stream": True}
    with httpx.stream("POST", f"{exo.url}/v1/chat/completions", json=body, headers=auth, timeout=120) as stream:
        assert stream.status_code == 200, stream.read()
        first = next(line for line in stream.iter_lines() if line.startswith("data: {"))
        command_id = json.loads(first.removeprefix("data: "))["id"]
        assert chat(exo.url, secret).status_code == 429  # the slot is taken while it runs
        cancelled = httpx.post(f"{exo.url}/v1/cancel/{command_id}", headers=auth, timeout=30)
        assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled", cancelled.text
    answer = chat(exo.url, secret)
    assert answer.status_code == 200, answer.text


def _bearer(secret: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}"}


def _stream_body(max_tokens: int) -> dict:
    return {"model": TINY_MODEL_ID, "messages": ASK, "max_tokens": max_tokens, "temperature": 0, "stream": True}


def _text_and_ends(lines) -> tuple[str, list[str]]:
    """A chat stream's text, and each finish_reason or error code it sent, in order."""
    text, ends = "", []
    for line in lines:
        if not line.startswith("data: {"):
            continue
        event = json.loads(line.removeprefix("data: "))
        if "error" in event:
            ends.append(event["error"]["code"])
            continue
        text += event["choices"][0]["delta"].get("content") or ""
        ends += [event["choices"][0]["finish_reason"]] if event["choices"][0]["finish_reason"] else []
    return text, ends


def _until_text(lines) -> list[str]:
    """A chat stream's lines up to its first with text."""
    read = []
    for line in lines:
        read.append(line)
        if line.startswith("data: {") and _text_and_ends([line])[0]:
            return read
    raise AssertionError(f"no text in {read}")


def _resumed(url: str, secret: str, command_id: str, how: str) -> httpx.Response:
    """The rest of generation `command_id` from its start, asked `how`: 'get' (the resume route) or
    'post' (a chat POST that reconnects with Last-Event-ID)."""
    if how == "get":
        return httpx.get(f"{url}/v1/chat/completions/chatcmpl-{command_id}/stream?after=-1", headers=_bearer(secret),
                         timeout=60)
    return httpx.post(f"{url}/v1/chat/completions", json=_stream_body(1000), timeout=60,
                      headers=_bearer(secret) | {"Last-Event-ID": f"chatcmpl-{command_id}:-1"})


def _another_keys_tries(url: str, secret: str, command_id: str) -> list[httpx.Response]:
    return [_resumed(url, secret, command_id, "get"), _resumed(url, secret, command_id, "post"),
            httpx.post(f"{url}/v1/cancel/chatcmpl-{command_id}", headers=_bearer(secret), timeout=30)]


def test_another_keys_generation_is_unknown_to_a_key_while_its_own_key_and_an_admin_may_resume_it(node):
    exo = node
    with admin_client(exo.url) as admin:
        owner_id, owner = add_key(admin, name="owner")
        _, stranger = add_key(admin, name="stranger")
    with httpx.stream("POST", f"{exo.url}/v1/chat/completions", json=_stream_body(1000), headers=_bearer(owner),
                      timeout=120) as reference:
        undisturbed = _text_and_ends(reference.iter_lines())
    assert undisturbed[1] == ["length"] and undisturbed[0]
    unknown_id = "0" * 32  # what an id nobody made gets, the answer another key's must not differ from
    unknown = [(r.status_code, r.text.replace(unknown_id, "{id}"))
               for r in _another_keys_tries(exo.url, stranger, unknown_id)]
    assert [status for status, _ in unknown] == [404, 404, 404], unknown
    with httpx.stream("POST", f"{exo.url}/v1/chat/completions", json=_stream_body(1000), headers=_bearer(owner),
                      timeout=120) as stream:  # a second or more of tokens: it runs while the stranger tries
        assert stream.status_code == 200, stream.read()
        lines = stream.iter_lines()
        read = _until_text(lines)  # the first text: the task runs (the role's chunk comes before it is queued)
        command_id = json.loads(read[-1].removeprefix("data: "))["id"].removeprefix("chatcmpl-")
        tried = [(r.status_code, r.text.replace(command_id, "{id}"))
                 for r in _another_keys_tries(exo.url, stranger, command_id)]
        with admin_client(exo.url) as admin:
            task = admin.get("/state").json()["tasks"][command_id]
        # The stranger's cancel came mid-stream and asked nothing of the master.
        assert (task["key_id"], task["status"] in ("pending", "running"), task["cancel_requested"]) == (owner_id, True, False)
        assert tried == unknown
        assert _text_and_ends([*read, *lines]) == undisturbed
    for secret, how in ((owner, "get"), (owner, "post"), (ADMIN, "get"), (ADMIN, "post")):
        again = _resumed(exo.url, secret, command_id, how)
        assert again.status_code == 200 and _text_and_ends(again.text.splitlines()) == undisturbed, (secret, how)
    assert [r.status_code for r in _another_keys_tries(exo.url, stranger, command_id)[:2]] == [404, 404]


def test_resuming_a_keys_own_generation_passes_its_model_scope(node):
    exo = node
    with admin_client(exo.url) as admin:
        key_id, secret = add_key(admin, models=[TINY_MODEL_ID])
        answer = chat(exo.url, secret)
        assert answer.status_code == 200, answer.text
        command_id = answer.json()["id"].removeprefix("chatcmpl-")
        assert _resumed(exo.url, secret, command_id, "get").status_code == 200
        assert admin.patch(f"/keys/{key_id}", json={"models": [OTHER]}).status_code == 200
        wait_until(lambda: _resumed(exo.url, secret, command_id, "get").status_code == 404, 5,
                   what="the generation of a model out of the key's scope refused")
        refused = _resumed(exo.url, secret, command_id, "post")
    assert refused.status_code == 404 and refused.json()["error"]["message"] == (
        f"no generation '{command_id}' (unknown, or finished too long ago)"), refused.text


def test_a_generation_is_cancelled_by_its_own_key_or_an_admin(node):
    exo = node
    with admin_client(exo.url) as admin:
        _, owner = add_key(admin, name="owner")
    for canceller in (owner, ADMIN):
        with httpx.stream("POST", f"{exo.url}/v1/chat/completions", json=_stream_body(30_000), headers=_bearer(owner),
                          timeout=120) as stream:
            lines = stream.iter_lines()
            first = next(line for line in lines if line.startswith("data: {"))
            shown_id = json.loads(first.removeprefix("data: "))["id"]
            cancelled = httpx.post(f"{exo.url}/v1/cancel/{shown_id}", headers=_bearer(canceller), timeout=30)
            assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled", cancelled.text
            assert _text_and_ends(lines)[1] == ["cancelled"]


def test_a_scoped_key_cannot_read_another_models_card_or_where_it_runs(node):
    exo = node
    with admin_client(exo.url) as admin:
        _, secret = add_key(admin, models=[TINY_MODEL_ID])
        wait_until(lambda: sorted(m["name"] for m in admin.get("/api/ps").json()["models"]) == sorted([OTHER, TINY_MODEL_ID]),
                   120, what="both models running")
        assert {TINY_MODEL_ID, OTHER} <= {m["name"] for m in admin.get("/api/tags").json()["models"]}
        assert admin.get(f"/v1/models/{OTHER}").status_code == 200
        assert admin.post("/api/show", json={"model": OTHER}).status_code == 200
    with httpx.Client(base_url=exo.url, headers=_bearer(secret), timeout=30) as scoped:
        assert [m["name"] for m in scoped.get("/api/tags").json()["models"]] == [TINY_MODEL_ID]
        assert [m["name"] for m in scoped.get("/api/ps").json()["models"]] == [TINY_MODEL_ID]
        assert scoped.get(f"/v1/models/{TINY_MODEL_ID}").json()["id"] == TINY_MODEL_ID
        assert scoped.post("/api/show", json={"model": TINY_MODEL_ID}).status_code == 200
        card = scoped.get(f"/v1/models/{OTHER}")
        unknown = scoped.get("/v1/models/local/nothing")
        show = scoped.post("/api/show", json={"model": OTHER})
    assert (card.status_code, card.json()) == (unknown.status_code, json.loads(unknown.text.replace("local/nothing", OTHER)))
    assert card.json()["error"]["message"] == (f"The model '{OTHER}' does not exist (GET /v1/models lists the models; "
                                               "POST /models/add adds one)")
    assert (show.status_code, show.json()) == (404, {"error": f"model '{OTHER}' not found"})
