"""A key's token limits and its deletion through a real node: a burst of concurrent chats is
admitted only as far as each one's reserved tokens (prompt bound + max_tokens) fit the key's daily
quota, so its usage never passes the quota; deleting a key ends its running stream with a clear
final error within seconds, and the tokens it used are still counted and shown to an admin."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from exo.core.reservations import CHAT_TOKENS, MESSAGE_TOKENS
from tests.support.api_keys import ADMIN, add_key, admin_client
from tests.support.cluster import wait_until
from tests.support.e2e import start_exo
from tests.support.fake_hub import FakeHub
from tests.support.tiny_model import TINY_MODEL_ID, make_tiny_model

pytestmark = pytest.mark.slow

ASK = [{"role": "user", "content": "Hello"}]
LONG = 1500  # tokens: seconds of generation for the tiny model, so a burst's requests are all open together
RESERVED = CHAT_TOKENS + MESSAGE_TOKENS + len("Hello") + LONG  # what each chat of the burst reserves


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    root = tmp_path_factory.mktemp("tenancy")
    model_dir = make_tiny_model(root / "tiny")
    with FakeHub({TINY_MODEL_ID: model_dir}) as hub:
        exo = start_exo(root, hub, {"EXO_API_KEYS": ADMIN})
        with admin_client(exo.url) as admin:
            assert admin.post("/models/add", json={"model_id": TINY_MODEL_ID}).status_code == 200
            placed = admin.post("/place_instance", json={"model_id": TINY_MODEL_ID, "wait": 120, "max_queue": 200})
            assert placed.status_code == 200, placed.text
        yield exo
        exo.interrupt()


def _usage(admin: httpx.Client, key_id: str) -> list[dict]:
    return [r for r in admin.get("/usage").json()["data"] if r["key_id"] == key_id]


def test_a_burst_of_concurrent_chats_is_admitted_as_far_as_their_reservations_fit_the_daily_quota(node):
    quota = 3 * RESERVED + 500  # room for three chats' reservations, not four
    with admin_client(node.url) as admin:
        key_id, secret = add_key(admin, limits={"tokens_per_day": quota})

    def chat(_: int) -> httpx.Response:
        return httpx.post(f"{node.url}/v1/chat/completions", headers={"Authorization": f"Bearer {secret}"}, timeout=300,
                          json={"model": TINY_MODEL_ID, "messages": ASK, "max_tokens": LONG, "temperature": 0})

    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(chat, range(16)))
    statuses = [a.status_code for a in answers]
    assert statuses.count(200) == 3 and statuses.count(429) == 13, statuses
    for refused in (a for a in answers if a.status_code == 429):
        assert f"of its daily quota of {quota} left today (UTC) besides the {3 * RESERVED} its open requests" \
               in refused.json()["error"]["message"] and refused.headers["Retry-After"] == "1", refused.text
    for answered in (a for a in answers if a.status_code == 200):
        used = answered.json()["usage"]
        assert used["completion_tokens"] == LONG and used["prompt_tokens"] <= RESERVED - LONG, used  # within its bound
    with admin_client(node.url) as admin:
        [row] = _usage(admin, key_id)
    assert row["requests"] == 3 and row["prompt_tokens"] + row["completion_tokens"] <= quota, row


def test_deleting_a_key_ends_its_stream_with_the_reason_and_its_tokens_stay_counted(node):
    with admin_client(node.url) as admin:
        key_id, secret = add_key(admin)
        body = {"model": TINY_MODEL_ID, "messages": ASK, "max_tokens": 30_000, "temperature": 0, "stream": True}
        with httpx.stream("POST", f"{node.url}/v1/chat/completions", json=body, timeout=120,
                          headers={"Authorization": f"Bearer {secret}"}) as stream:
            assert stream.status_code == 200, stream.read()
            events = (json.loads(line.removeprefix("data: ")) for line in stream.iter_lines() if line.startswith("data: {"))
            next(e for e in events if "choices" in e and e["choices"][0]["delta"].get("content"))  # it generates
            assert admin.delete(f"/keys/{key_id}").status_code == 200
            deleted = time.monotonic()
            rest = list(events)
            ended_after = time.monotonic() - deleted
        assert rest[-1] == {"error": {"message": "the API key was deleted", "type": "internal_error",
                                      "code": "cancelled"}}, rest[-3:]
        assert ended_after < 5.0
        assert key_id not in [k["key_id"] for k in admin.get("/keys").json()["data"]]
        [row] = wait_until(lambda: [r for r in _usage(admin, key_id) if r["completion_tokens"] > 0], 10,
                           what="the deleted key's tokens counted")
    assert row["requests"] == 1 and 0 < row["completion_tokens"] < 30_000, row
