"""The dashboard for whoever holds the key, in headless Chromium against a real `exo` node: a key
without admin gets the chat (its greedy answer equals the API's) and its own limits and usage,
and no admin panel, no request its role refuses and no error toast; an admin gets a Keys panel
(every key added, with its usage), creates a key (its secret shown once) and deletes one. A failed
instance says why once and is removed in one click. On hand-made States: the chat offers chat
models first and never chooses an embedding model, nor a failed instance's."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import msgspec
import pytest

from exo.core.state import State
from exo.core.types import EmbeddingSpec, Instance, ModelCard, RunnerInfo, ShardAssignment
from tests.support.dashboard import KEY, answer_the_key_prompt, chromium_page, exo_node, open_with_key, shown, what_the_page_saw
from tests.support.polling import wait_until
from tests.support.tiny_model import TINY_MODEL_ID, make_tiny_model

pytestmark = pytest.mark.slow

GONE = "exo-test/gone-keys"  # a card whose repository the Hub does not have: its download fails
ADMIN_ONLY = ["#nodes-panel", "#instances-panel", "#models-panel", "#place-panel", "#downloads-panel", "#events-panel",
              "#keys-panel", "#banner", "#conn", "#seq", 'a[href="#keys-panel"]']
# Every toast the page shows, kept after it fades (toasts go after 6 s).
RECORD_TOASTS = """window.toasts = [];
document.addEventListener("DOMContentLoaded", () => new MutationObserver((changes) => {
    for (const change of changes) for (const node of change.addedNodes) window.toasts.push(node.textContent);
}).observe(document.getElementById("toasts"), {childList: true}));"""


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("model") / "tiny-llama")


@pytest.fixture(scope="module")
def node(tiny, tmp_path_factory):
    with exo_node(tmp_path_factory.mktemp("node"), {TINY_MODEL_ID: tiny}) as exo:
        yield exo


@pytest.fixture(scope="module")
def http(node):
    with httpx.Client(base_url=node.url, timeout=120, headers={"Authorization": f"Bearer {KEY}"}) as client:
        yield client


@pytest.fixture(scope="module")
def placed(http) -> str:
    assert http.post("/models/add", json={"model_id": TINY_MODEL_ID}).status_code == 200
    placed = http.post("/place_instance", json={"model_id": TINY_MODEL_ID})
    assert placed.status_code == 200, placed.text
    instance_id = placed.json()["instance_id"]
    wait_until(lambda: http.get(f"/instance/{instance_id}").json()["status"] == "ready", 120, 0.3,
               what="the tiny model's instance ready")
    return instance_id


@pytest.fixture
def browser(tmp_path):
    with chromium_page(tmp_path / "chromium-profile") as page:
        page.add_init_script(RECORD_TOASTS)
        yield page
        assert page.errors == [], page.errors


def add_key(http, **body) -> tuple[str, str]:
    added = http.post("/keys", json=body)
    assert added.status_code == 200, added.text
    return added.json()["key"]["key_id"], added.json()["secret"]


def test_a_user_key_chats_and_sees_its_own_usage_and_limits_and_no_admin_panel(browser, node, http, placed):
    key_id, secret = add_key(http, name="alice", limits={"tokens_per_day": 100_000, "requests_per_minute": 30})
    asked: list[str] = []
    browser.on("request", lambda r: asked.append(r.url.removeprefix(node.url)))
    browser.goto(node.url)
    answer_the_key_prompt(browser, node, secret, 'body[data-role="user"]')
    for selector in ADMIN_ONLY:
        assert browser.locator(selector).is_hidden(), selector
    assert browser.locator("#chat-panel").is_visible() and browser.locator("#account-panel").is_visible()
    shown(browser, node, f'#chat-model option[value="{TINY_MODEL_ID}"]', "attached")
    assert browser.input_value("#chat-model") == TINY_MODEL_ID

    browser.fill("#chat-max-tokens", "8")
    browser.fill("#chat-temperature", "0")
    browser.fill("#chat-input", "Tell me about the sea.")
    with browser.expect_request(lambda r: r.url.endswith("/v1/chat/completions")) as sent:
        browser.click("#chat-send")
    reply = browser.locator('.msg.assistant[data-streaming="false"]')
    reply.wait_for(timeout=60_000)
    with httpx.Client(base_url=node.url, timeout=60, headers={"Authorization": f"Bearer {secret}"}) as alice:
        api = alice.post("/v1/chat/completions", json=json.loads(sent.value.post_data) | {"stream": False}).json()
        assert reply.locator(".text").text_content() == api["choices"][0]["message"]["content"] != ""
        rows = wait_until(lambda: (r := alice.get("/usage").json()["data"]) and sum(x["requests"] for x in r) == 2 and r,
                          10, what="both requests counted")
    tokens = sum(r["prompt_tokens"] + r["completion_tokens"] for r in rows)

    today = browser.locator('#account [data-usage="today"]')
    for _ in range(40):  # a visible page asks again at once (else every 10 s)
        if (today.get_attribute("data-requests"), today.get_attribute("data-tokens")) == ("2", str(tokens)):
            break
        browser.evaluate("document.dispatchEvent(new Event('visibilitychange'))")
        browser.wait_for_timeout(250)
    assert re.fullmatch(rf"Today \(UTC \d{{4}}-\d\d-\d\d\): 2 requests, {tokens:,} tokens of 100,000 a day",
                        today.inner_text()), f"{today.inner_text()}\n{what_the_page_saw(browser, node)}"
    assert browser.locator("#account").inner_text().startswith(f"alice {key_id} · may use every model · interactive")
    limits = browser.locator("#account [data-limit]")
    assert [(li.get_attribute("data-limit"), li.inner_text()) for li in limits.all()] == [
        ("requests_per_minute", "requests per minute: 30"), ("tokens_per_day", "tokens per day: 100,000")]

    refused = [line for line in browser.seen if " s 403 " in line]
    assert refused == [], what_the_page_saw(browser, node)
    assert not [path for path in asked if path.startswith(("/state", "/events", "/node_id", "/keys"))], asked
    assert browser.evaluate("window.toasts") == []


def test_an_admin_sees_every_key_with_its_usage_creates_one_shown_once_and_deletes_it(browser, node, http):
    ops_id, _ = add_key(http, name="ops", admin=True)
    reader_id, _ = add_key(http, name="reader", models=["exo-test/*"], limits={"concurrent_requests": 2})
    open_with_key(browser, node)
    ops, reader = (browser.locator(f'#keys tr[data-key-id="{k}"]') for k in (ops_id, reader_id))
    shown(browser, node, f'#keys tr[data-key-id="{reader_id}"]')
    cells = lambda row: [cell.inner_text() for cell in row.locator("td").all()][:5]  # noqa: E731
    assert cells(ops) == [f"ops\n{ops_id}", "admin", "none", "0 req · 0 tokens", "0 tokens"]
    assert cells(reader) == [f"reader\n{reader_id}", "exo-test/*", "2 concurrent requests", "0 req · 0 tokens", "0 tokens"]

    browser.fill('#add-key-form [name="key-name"]', "carol")
    browser.fill('#add-key-form [name="key-models"]', "org/a, org/b*")
    browser.fill('#add-key-form [name="key-tokens_per_day"]', "500")
    browser.click("#add-key-form button[type=submit]")
    secret_box = browser.locator("#key-secret code.secret")
    secret_box.wait_for()
    secret, carol_id = secret_box.inner_text(), secret_box.get_attribute("data-key-id")
    assert secret.startswith("exo-")
    carol = http.get(f"/keys/{carol_id}").json()
    assert (carol["name"], carol["admin"], carol["models"], carol["limits"]["tokens_per_day"]) == (
        "carol", False, ["org/a", "org/b*"], 500)
    assert httpx.get(f"{node.url}/v1/models", headers={"Authorization": f"Bearer {secret}"}).status_code == 200
    shown(browser, node, f'#keys tr[data-key-id="{carol_id}"]')
    assert browser.content().count(secret) == 1  # in the box, nowhere in the table
    browser.reload()
    shown(browser, node, f'#keys tr[data-key-id="{carol_id}"]')
    assert secret not in browser.content() and browser.locator("#key-secret").is_hidden()  # once: never again

    delete = browser.locator(f'#keys tr[data-key-id="{carol_id}"] [data-action="delete-key"]')
    delete.click()
    delete.click()  # "Sure?"
    browser.locator(f'#keys tr[data-key-id="{carol_id}"]').wait_for(state="detached")
    assert carol_id not in [k["key_id"] for k in http.get("/keys").json()["data"]]
    assert httpx.get(f"{node.url}/v1/models", headers={"Authorization": f"Bearer {secret}"}).status_code == 401
    assert browser.evaluate("window.toasts") == []


def test_a_failed_instance_says_why_once_and_is_removed_in_one_click(browser, node, http):
    card = http.get(f"/v1/models/{TINY_MODEL_ID}")
    if card.status_code != 200:
        assert http.post("/models/add", json={"model_id": TINY_MODEL_ID}).status_code == 200
        card = http.get(f"/v1/models/{TINY_MODEL_ID}")
    added = http.post("/models/add", json=card.json()["card"] | {"model_id": GONE, "name": "", "storage_bytes": 1_000_000})
    assert added.status_code == 200, added.text
    instance_id = http.post("/place_instance", json={"model_id": GONE}).json()["instance_id"]
    open_with_key(browser, node)
    failed = browser.locator(f'.card.instance[data-instance-id="{instance_id}"][data-status="failed"]')
    failed.wait_for(timeout=60_000)
    reason = http.get(f"/instance/{instance_id}").json()
    said = failed.locator(".instance-error").inner_text()
    assert said.startswith("not_found: download failed:"), said
    text = failed.inner_text()
    assert text.count(said.split(": ", 1)[1]) == 1 and text.count("download failed") == 1, text
    assert reason["status"] == "failed"
    assert GONE not in [o for o in browser.locator("#chat-model option").evaluate_all("os => os.map((o) => o.value)")]
    assert failed.locator('[data-action="delete-instance"]').count() == 0
    failed.locator('[data-action="remove-instance"]').click()  # once: nothing to confirm
    failed.wait_for(state="detached")
    assert instance_id not in http.get("/state").json()["instances"]
    assert http.delete(f"/models/custom/{GONE}").status_code == 200


# -- hand-made States, drawn by chat.js alone (main.js is not run: the page's own State stays out) --

OFFER = """(state) => import("/dashboard/chat.js").then(({Chat}) => {
    const chat = new Chat({card: (id) => state.custom_model_cards[id], toast: () => {}});
    chat.update(state);
    const select = document.getElementById("chat-model");
    return {chosen: select.value, options: [...select.options].map((o) => [o.value, o.disabled, o.textContent])};
})"""


def running(models: dict[str, str], embedders: set[str]) -> State:
    """Each model with one instance whose runner has that status; `embedders`' cards embed."""
    cards = {m: ModelCard(model_id=m, embedding=EmbeddingSpec() if m in embedders else None) for m in models}  # type: ignore[arg-type]
    instances = {f"i-{m}": Instance(instance_id=f"i-{m}", model_id=m, shards=[  # type: ignore[arg-type]
        ShardAssignment(runner_id=f"r-{m}", node_id="a", rank=0, world_size=1, start_layer=0, end_layer=2)]) for m in models}
    runners = {f"r-{m}": RunnerInfo(runner_id=f"r-{m}", instance_id=f"i-{m}", node_id="a", status=s)  # type: ignore[arg-type]
               for m, s in models.items()}
    return State(custom_model_cards=cards, instances=instances, runners=runners)  # type: ignore[arg-type]


def test_the_chat_offers_chat_models_first_and_never_chooses_an_embedding_model(browser, node):
    browser.route("**/dashboard/main.js", lambda route: route.fulfill(body="", content_type="text/javascript"))
    browser.goto(node.url)
    state = running({"a/embedder": "ready", "b/chat": "ready", "a/loading": "loading", "a/broken": "failed"}, {"a/embedder"})
    offered = browser.evaluate(OFFER, msgspec.to_builtins(state))
    assert offered == {"chosen": "b/chat", "options": [
        ["b/chat", False, "b/chat"], ["a/loading", False, "a/loading (loading)"],
        ["a/embedder", True, "a/embedder (embedding: not for chat)"]]}

    only = browser.evaluate(OFFER, msgspec.to_builtins(running({"a/embedder": "ready"}, {"a/embedder"})))
    assert only == {"chosen": "", "options": [["", False, "no chat model running"],
                                              ["a/embedder", True, "a/embedder (embedding: not for chat)"]]}
    assert browser.is_disabled("#chat-send")
