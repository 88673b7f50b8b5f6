"""The dashboard at GET / drives a real `exo` node in headless Chromium: key prompt, add a card,
place an instance from a preview, watch its runner become ready, see where the model is (as
/v1/models and /api/tags say) and the instance's numbers, chat (the streamed text equals the API's
answer to the same request), stop a long generation, delete the instance and the card; attach
images for a vision model (picked and pasted) and find them in the task State holds. Its files,
served in process: tests/test_dashboard_files.py; what goes wrong: tests/test_dashboard_status.py."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import shutil
import time
from pathlib import Path

import httpx
import pytest

from tests.support.cluster import wait_until
from tests.support.dashboard import KEY, answer_the_key_prompt, chromium_page, exo_node, open_with_key, shown
from tests.support.tiny_model import TINY_MODEL_ID, make_tiny_model
from tests.support.vision_model import make_vision_model, png

PROMPT = "Tell me about the sea."
MAX_TOKENS = 24
VISION_ID = "local/vision-dash"
LONG = 30_000  # never reached: the tiny model does not stop on its own (its context: 32768)
# EXO_SCREENSHOT_DIR=folder keeps the two screenshots for review (nothing is left in /tmp otherwise).
REVIEW_DIR = os.environ.get("EXO_SCREENSHOT_DIR")


# -- the page in Chromium against a real node ------------------------------------------------

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


@pytest.fixture
def page(tmp_path):
    with chromium_page(tmp_path / "chromium-profile") as page:
        yield page


@pytest.mark.slow
def test_the_dashboard_places_chats_stops_and_deletes(page, node, http, tmp_path):
    node_id = http.get("/node_id").json()
    state_fetches: list[float] = []
    page.on("request", lambda r: state_fetches.append(time.monotonic()) if r.url.endswith("/state") else None)

    page.goto(node.url)
    _enter_the_key_once(page, node)
    node_card = page.locator(f'.card.node[data-node-id="{node_id}"]')
    assert "this node" in node_card.inner_text() and "backend cpu" in node_card.inner_text()

    _add_the_card(page, http)
    instance_id = _place_from_a_preview(page, http, node_id)
    _where_the_model_is(page, http, node_id, instance_id)
    _the_instance_numbers(page, http, instance_id)
    _the_feed_shows_sequences(page, http, instance_id)
    _chat_equals_the_api(page, http)
    _rate_and_prompt_cache(page, http, node_id, instance_id)
    command_id = _stop_a_long_generation(page, http)

    page.evaluate("window.scrollTo(0, 0)")  # else the sticky header is drawn mid-page
    page.screenshot(path=str(tmp_path / "dashboard.png"), full_page=True)
    page.set_viewport_size({"width": 390, "height": 844})
    page.emulate_media(color_scheme="dark")  # the dark look; the laptop shot shows the light one
    page.evaluate("window.scrollTo(0, 0)")
    page.screenshot(path=str(tmp_path / "dashboard-phone.png"), full_page=True)
    if REVIEW_DIR:
        for shot in ("dashboard.png", "dashboard-phone.png"):
            shutil.copyfile(tmp_path / shot, Path(REVIEW_DIR) / shot)
    _fits_the_width(page, 390)
    page.set_viewport_size({"width": 1440, "height": 1000})

    _no_polling(page, state_fetches)
    _delete_instance_and_card(page, http, instance_id)
    assert page.errors == [], page.errors
    assert http.get("/state").json()["tasks"][command_id]["status"] == "cancelled"


def _enter_the_key_once(page, node) -> None:
    answer_the_key_prompt(page, node)
    assert page.evaluate("localStorage.getItem('exo.apiKey')") == KEY
    page.reload()  # kept: the page does not ask again
    shown(page, node, '#conn[data-state="live"]')
    assert not page.locator("#key-dialog").is_visible()


def _add_the_card(page, http) -> None:
    page.fill("#add-model-id", TINY_MODEL_ID)
    page.click("#add-model-form button[type=submit]")
    row = page.locator(f'.model-row[data-model-id="{TINY_MODEL_ID}"]')
    row.locator(".tag.custom").wait_for()
    assert "2 layers" in row.inner_text()
    assert TINY_MODEL_ID in http.get("/state").json()["custom_model_cards"]
    builtin = page.locator('.model-row[data-model-id="mlx-community/Qwen3-0.6B-4bit"]')
    assert "built-in" in builtin.inner_text() and builtin.locator('[data-action="delete-model"]').count() == 0


def _place_from_a_preview(page, http, node_id: str) -> str:
    page.locator(f'.model-row[data-model-id="{TINY_MODEL_ID}"] [data-action="choose-model"]').click()
    preview = page.locator('.preview[data-sharding="pipeline"][data-min-nodes="1"]')
    preview.locator('[data-action="place"]').wait_for()
    info = http.get("/state").json()["nodes"][node_id]
    assert f"rank 0 on {info['name'] or info['hostname']}: layers 0–1" in preview.inner_text()
    assert http.get("/state").json()["instances"] == {}  # a preview places nothing
    preview.locator('[data-action="place"]').click()

    card = page.locator(f'.card.instance[data-model-id="{TINY_MODEL_ID}"]')
    card.wait_for()
    instance_id = card.get_attribute("data-instance-id")
    card.locator('[data-runner-status="ready"]').wait_for(timeout=180_000)
    assert card.get_attribute("data-status") == "ready"
    (instance,) = http.get("/state").json()["instances"].values()
    assert instance["instance_id"] == instance_id
    (runner,) = [r for r in http.get("/state").json()["runners"].values() if r["instance_id"] == instance_id]
    assert runner["status"] == "ready"
    shard = page.locator(f'.card.node[data-node-id="{node_id}"] .shard')
    assert "pipeline · rank 0/1 · layers 0–1 of 2" in shard.inner_text()
    assert shard.locator('[data-runner-status="ready"]').count() == 1
    return instance_id


def _where_the_model_is(page, http, node_id: str, instance_id: str) -> None:
    """The page, /v1/models and /api/tags agree: ready and downloaded on this node; the built-in
    card on no node, still listed. The instance's status is the one GET /instance/{id} gives."""
    row = page.locator(f'.model-row[data-model-id="{TINY_MODEL_ID}"]')
    row.locator('[data-instances="ready"]').wait_for()
    assert row.locator(".tag[data-instances]").all_inner_texts() == ["1 ready"]
    where = row.locator(".where")
    assert (where.get_attribute("data-ready-on"), where.get_attribute("data-downloaded-on")) == (node_id, node_id)
    info = http.get("/state").json()["nodes"][node_id]
    assert f"ready on {info['name'] or info['hostname']}" in where.inner_text()
    builtin = "mlx-community/Qwen3-0.6B-4bit"
    assert page.locator(f'.model-row[data-model-id="{builtin}"] .where').inner_text() == "on no node"

    listed = {m["id"]: m for m in http.get("/v1/models").json()["data"]}
    tags = {m["name"]: m for m in http.get("/api/tags").json()["models"]}
    assert set(listed) == set(tags) and {TINY_MODEL_ID, builtin} <= set(listed)  # every card stays listed
    for entries in (listed, tags):
        assert (entries[TINY_MODEL_ID]["ready_on_ids"], entries[TINY_MODEL_ID]["downloaded_on_ids"]) == ([node_id], [node_id])
        name = info["name"] or info["hostname"]
        assert (entries[TINY_MODEL_ID]["ready_on"], entries[TINY_MODEL_ID]["downloaded_on"]) == ([name], [name])
        assert (entries[builtin]["ready_on"], entries[builtin]["downloaded_on"]) == ([], [])

    card = page.locator(f'.card.instance[data-instance-id="{instance_id}"]')
    assert card.get_attribute("data-status") == http.get(f"/instance/{instance_id}").json()["status"] == "ready"
    assert card.locator(".layers").get_attribute("data-layers-status") == "ready"


def _the_instance_numbers(page, http, instance_id: str) -> None:
    instance = http.get(f"/instance/{instance_id}").json()
    card = page.locator(f'.card.instance[data-instance-id="{instance_id}"]')
    kv_bytes = sum(shard["kv_bytes"] for shard in instance["shards"])
    assert int(card.get_attribute("data-max-context")) == instance["max_context"] > 0
    assert int(card.get_attribute("data-kv-bytes")) == kv_bytes > 0
    text = card.locator(".stats").inner_text()
    assert f"context {instance['max_context']:,} tokens" in text and "KV " in text and "0 open" in text


def _rate_and_prompt_cache(page, http, node_id: str, instance_id: str) -> None:
    """Tokens per second of the two requests the page saw; the prompt cache's hits and misses as the
    node's heartbeat reports them (the API's request repeated the page's prompt)."""
    card = page.locator(f'.card.instance[data-instance-id="{instance_id}"]')
    page.wait_for_function(f"""() => Number(document.querySelector('.card.instance[data-instance-id="{instance_id}"]')
                                            .dataset.tokensPerS) > 0""")
    assert re.search(r"[\d.]+ tok/s \(\d req\)", card.locator(".stats").inner_text())

    def shown_as_held() -> bool:
        stats = http.get("/state").json()["nodes"][node_id]["prompt_caches"].get(instance_id)
        if not stats or stats["hits"] + stats["misses"] < 2:
            return False
        return (int(card.get_attribute("data-cache-hits")), int(card.get_attribute("data-cache-misses"))) == (
            stats["hits"], stats["misses"])

    wait_until(shown_as_held, 30, 0.2, what="the page showing the prompt cache the node reports")
    hits = int(card.get_attribute("data-cache-hits"))
    asked = hits + int(card.get_attribute("data-cache-misses"))
    assert hits >= 1 and f"prompt cache {round(100 * hits / asked)}% hits ({hits}/{asked})" in card.inner_text()


def _the_feed_shows_sequences(page, http, instance_id: str) -> None:
    created_seq = http.get(f"/instance/{instance_id}").json()["created_seq"]
    row = page.locator(f'.event[data-seq="{created_seq}"]')
    assert row.get_attribute("data-kind") == "instance.created"
    assert row.locator(".seq").inner_text() == f"#{created_seq}"
    # The runner's way to ready is in the feed, in order.
    summaries = page.locator('.event[data-kind="runner.status"] .summary').all_inner_texts()
    statuses = [re.search(r"→ (\w+)", t).group(1) for t in summaries]
    assert statuses[0] == "ready" and "loading" in statuses  # newest first
    created = page.locator('.event[data-kind="instance.created"]').count()  # 1, unless another test placed before
    page.select_option("#events-kind", "instance.created")
    assert page.locator(".event").count() == created >= 1
    page.select_option("#events-kind", "")
    page.fill("#events-filter", f"#{created_seq}")
    assert [int(s) for s in page.locator(".event").evaluate_all("rows => rows.map(r => r.dataset.seq)")] == [created_seq]
    page.fill("#events-filter", "")


def _chat_equals_the_api(page, http) -> None:
    page.fill("#chat-max-tokens", str(MAX_TOKENS))
    page.fill("#chat-temperature", "0")
    page.fill("#chat-input", PROMPT)
    page.evaluate("""() => {  // count text changes: the reply must arrive in pieces, not at once
        window.textChanges = 0;
        new MutationObserver((m) => { window.textChanges += m.length; })
            .observe(document.getElementById('chat-log'), {subtree: true, characterData: true});
    }""")
    with page.expect_request(lambda r: r.url.endswith("/v1/chat/completions")) as sent:
        page.click("#chat-send")
    body = json.loads(sent.value.post_data)
    assert body == {"model": TINY_MODEL_ID, "messages": [{"role": "user", "content": PROMPT}], "stream": True,
                    "stream_options": {"include_usage": True}, "max_tokens": MAX_TOKENS, "temperature": 0}
    reply = page.locator('.msg.assistant[data-streaming="false"]')
    reply.wait_for(timeout=60_000)
    shown = reply.locator(".text").text_content()

    api = http.post("/v1/chat/completions", json=body | {"stream": False}).json()
    assert shown == api["choices"][0]["message"]["content"]
    assert len(shown) > MAX_TOKENS // 2
    assert page.evaluate("window.textChanges") > 1
    assert reply.get_attribute("data-finish") == "length"
    assert int(reply.get_attribute("data-ttft-ms")) > 0 and float(reply.get_attribute("data-tokens-per-s")) > 0
    stats = page.inner_text("#chat-stats")
    assert re.fullmatch(rf"TTFT \d+ ms · [\d.]+ tok/s · {MAX_TOKENS} tokens · length", stats), stats


def _stop_a_long_generation(page, http) -> str:
    page.click("#chat-clear")
    assert page.locator(".msg").count() == 0
    page.fill("#chat-max-tokens", str(LONG))
    page.fill("#chat-input", PROMPT)
    page.click("#chat-send")
    reply = page.locator(".msg.assistant")
    page.wait_for_function("() => document.querySelector('.msg.assistant .text').textContent.length > 20")
    command_id = reply.get_attribute("data-command-id")
    # State hears a generation is running once it has run for a second (exo/worker/runners.py).
    wait_until(lambda: http.get("/state").json()["tasks"][command_id]["status"] == "running", 10,
               what="the task reported running")
    card = page.locator(".card.instance")
    page.wait_for_function("() => document.querySelector('.card.instance').dataset.running === '1'", timeout=10_000)
    assert (card.get_attribute("data-running"), card.get_attribute("data-open")) == ("1", "1")
    assert "1 open (1 running, 0 queued)" in card.locator(".stats").inner_text()
    started = time.monotonic()
    page.click("#chat-stop")
    page.wait_for_selector('.msg.assistant[data-streaming="false"]', timeout=15_000)
    assert time.monotonic() - started < 5  # the cancel route, not the resume grace or the abort fallback
    assert reply.get_attribute("data-finish") == "cancelled"
    task = http.get("/state").json()["tasks"][command_id]
    assert task["status"] == "cancelled" and 0 < task["completion_tokens"] < LONG
    # The stopped stream had no usage chunk; the count comes from its task.finished event.
    tokens = f" {task['completion_tokens']} tokens"
    page.wait_for_function(f"() => document.getElementById('chat-stats').textContent.includes('{tokens}')")
    assert "stopped" in page.inner_text("#chat-stats")
    assert page.is_enabled("#chat-send") and not page.is_enabled("#chat-stop")
    return command_id


def _fits_the_width(page, width: int) -> None:
    overflow = page.evaluate("() => document.documentElement.scrollWidth")
    assert overflow <= width, f"the page is {overflow} px wide on a {width} px screen"


def _no_polling(page, state_fetches: list[float]) -> None:
    quiet_from = time.monotonic()
    page.wait_for_timeout(3000)
    assert [t for t in state_fetches if t > quiet_from] == []


def _confirm(button, gone) -> None:
    """Click a confirm button twice (the first click only asks) until `gone` is gone. An event that
    re-renders the list between the two clicks (the deleted instance's runner stopping, on a busy
    machine) gives a fresh button that is not armed: click again, as a person would."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeoutError

    for _ in range(3):
        button.click()
        button.click()
        try:
            gone.wait_for(state="detached", timeout=10_000)
            return
        except PlaywrightTimeoutError:
            continue
    gone.wait_for(state="detached", timeout=1)


def _delete_instance_and_card(page, http, instance_id: str) -> None:
    from playwright.sync_api import TimeoutError as PlaywrightTimeoutError

    delete = page.locator(f'.card.instance[data-instance-id="{instance_id}"] [data-action="delete-instance"]')
    delete.click()
    assert http.get("/state").json()["instances"] != {}  # the first click only asks
    delete.click()
    card = page.locator(".card.instance").first
    try:
        card.wait_for(state="detached", timeout=10_000)
    except PlaywrightTimeoutError:  # the stopped generation's late events re-rendered the card between
        _confirm(delete, card)      # the two clicks, so the second armed a fresh button (seen in full runs)
    assert http.get("/state").json()["instances"] == {}
    page.wait_for_selector("#chat-model option:text('no running model: place one')", state="attached")

    delete_card = page.locator(f'.model-row[data-model-id="{TINY_MODEL_ID}"] [data-action="delete-model"]')
    _confirm(delete_card, page.locator(f'.model-row[data-model-id="{TINY_MODEL_ID}"]'))
    assert http.get("/state").json()["custom_model_cards"] == {}


@pytest.mark.slow
def test_the_chat_sends_images_to_a_vision_model(page, node, http, tmp_path):
    vision_dir = make_vision_model(tmp_path / "vision")
    picked, pasted = tmp_path / "picked.png", png(2)
    picked.write_bytes(png(1))
    added = http.post("/models/add", json={"model_id": VISION_ID, "path": str(vision_dir), "supports_images": True})
    assert added.status_code == 200, added.text
    assert http.post("/models/add", json={"model_id": TINY_MODEL_ID}).status_code == 200
    instances = []
    try:
        for model_id in (TINY_MODEL_ID, VISION_ID):
            placed = http.post("/place_instance", json={"model_id": model_id, "wait": True})
            assert placed.status_code == 200, placed.text
            instances.append(placed.json()["instance_id"])
        open_with_key(page, node)
        page.select_option("#chat-model", TINY_MODEL_ID)
        assert not page.is_visible("#chat-attach") and page.is_disabled("#chat-files")  # a text model takes none

        page.select_option("#chat-model", VISION_ID)
        page.wait_for_selector("#chat-attach:visible")
        page.set_input_files("#chat-files", str(picked))
        page.evaluate("""(b64) => {  // a pasted image, as the clipboard hands it over
            const data = new DataTransfer();
            data.items.add(new File([Uint8Array.from(atob(b64), (c) => c.charCodeAt(0))], "paste.png", {type: "image/png"}));
            document.getElementById("chat-input").dispatchEvent(new ClipboardEvent("paste", {clipboardData: data}));
        }""", base64.b64encode(pasted).decode())
        page.wait_for_function("() => document.querySelectorAll('#chat-images img').length === 2")
        page.click('#chat-images [aria-label="remove image 2"]')
        assert page.locator("#chat-images img").count() == 1
        page.fill("#chat-max-tokens", "8")
        page.fill("#chat-temperature", "0")
        url = "data:image/png;base64," + base64.b64encode(picked.read_bytes()).decode()
        digest = hashlib.sha256(picked.read_bytes()).hexdigest()
        since = http.get("/state").json()["last_seq"]
        first = _send_and_wait(page, PROMPT)
        assert first["messages"] == [{"role": "user", "content": [
            {"type": "text", "text": PROMPT}, {"type": "image_url", "image_url": {"url": url}}]}]
        shown = page.locator(".msg.user .thumbs img")
        assert shown.count() == 1 and shown.get_attribute("src") == url
        assert page.locator("#chat-images img").count() == 0  # sent: nothing waits for the next message

        second = _send_and_wait(page, "And now?")  # the earlier turn's image goes again with the history
        assert second["messages"][0] == first["messages"][0] and second["messages"][2]["content"] == "And now?"
        command_ids = [reply.get_attribute("data-command-id") for reply in page.locator(".msg.assistant").all()]
        for task in _created_tasks(http, since, command_ids):
            assert [m.get("images") for m in task["params"]["messages"] if m.get("images")] == [[digest]]
        assert page.errors == [], page.errors
    finally:
        for instance_id in instances:
            http.delete(f"/instance/{instance_id}")
        for model_id in (VISION_ID, TINY_MODEL_ID):
            http.delete(f"/models/custom/{model_id}")
        wait_until(lambda: not http.get("/state").json()["instances"], 30, 0.2,  # the other test starts from none
                   what="no instance left")


def _send_and_wait(page, prompt: str) -> dict:
    page.fill("#chat-input", prompt)
    done = page.locator('.msg.assistant[data-streaming="false"]').count()
    with page.expect_request(lambda r: r.url.endswith("/v1/chat/completions")) as sent:
        page.click("#chat-send")
    reply = page.locator('.msg.assistant[data-streaming="false"]').nth(done)
    reply.wait_for(timeout=60_000)
    assert reply.get_attribute("data-finish") == "length", reply.inner_text()
    return json.loads(sent.value.post_data)


def _created_tasks(http, since: int, task_ids: list[str]) -> list[dict]:
    """The tasks as task.created put them into State (a finished task keeps no messages there)."""
    found: dict[str, dict] = {}
    with http.stream("GET", "/events", params={"since": since}) as response:
        for line in response.iter_lines():
            data = json.loads(line[6:]) if line.startswith("data: {") else {}
            if data.get("kind") == "task.created" and data["task"]["task_id"] in task_ids:
                found[data["task"]["task_id"]] = data["task"]
                if len(found) == len(task_ids):
                    break
    return [found[task_id] for task_id in task_ids]
