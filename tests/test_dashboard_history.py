"""GET /metrics/history and the dashboard's History panel against a real `exo` node (the tiny model,
samples every half second through EXO_METRICS_HISTORY_S): known requests count exactly (requests and
tokens per model, TTFT observations as /metrics counts them), an open request shows in the queue and
leaves it, memory is State's by node name, the key is asked as for /metrics; in headless Chromium the
charts are drawn with their series and take new samples without a reload. The samples' arithmetic
on hand-made States: tests/test_metrics_history.py."""

from __future__ import annotations

import re
import threading
from pathlib import Path

import httpx
import pytest

from tests.support.dashboard import KEY, chromium_page, exo_node, open_with_key, shown, what_the_page_saw
from tests.support.e2e import place
from tests.support.polling import wait_until
from tests.support.tiny_model import TINY_MODEL_ID, make_tiny_model

pytestmark = pytest.mark.slow

INTERVAL_S = 0.5
ASKED = 3
MAX_TOKENS = 8  # the tiny model never stops on its own: each request generates exactly this many
LONG = 30_000
CHARTS = ("tokens", "requests", "queue", "ttft", "memory")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("model") / "tiny-llama")


@pytest.fixture(scope="module")
def node(tiny, tmp_path_factory):
    with exo_node(tmp_path_factory.mktemp("node"), {TINY_MODEL_ID: tiny},
                  {"EXO_METRICS_HISTORY_S": str(INTERVAL_S)}) as exo:
        yield exo


@pytest.fixture(scope="module")
def http(node):
    with httpx.Client(base_url=node.url, timeout=120, headers={"Authorization": f"Bearer {KEY}"}) as client:
        yield client


@pytest.fixture(scope="module")
def placed(http) -> str:
    instance_id = place(http, TINY_MODEL_ID)
    wait_until(lambda: http.get(f"/instance/{instance_id}").json()["status"] == "ready", 120, 0.3,
               what="the tiny model's instance ready")
    return instance_id


def samples(http, after: float | None = None) -> list[dict]:
    answer = http.get("/metrics/history", params={} if after is None else {"after": repr(after)})
    assert answer.status_code == 200, answer.text
    found: list[dict] = answer.json()["samples"]
    return found


def next_sample(http, after: float) -> dict:
    """The first sample taken after `after` (unix seconds of an earlier sample)."""
    return wait_until(lambda: next(iter(samples(http, after)), None), 10, 0.1, what="a new sample")


def ttft_count(http) -> float:
    found = re.search(r"^exo_time_to_first_token_seconds_count (\S+)$", http.get("/metrics").text, re.M)
    assert found is not None
    return float(found.group(1))


def ask(http, max_tokens: int) -> dict:
    answer = http.post("/v1/chat/completions", json={"model": TINY_MODEL_ID, "max_tokens": max_tokens,
                                                     "messages": [{"role": "user", "content": "Tell me about the sea."}]})
    assert answer.status_code == 200, answer.text
    body: dict = answer.json()
    return body


@pytest.fixture
def page(tmp_path):
    with chromium_page(tmp_path / "chromium-profile") as page:
        yield page


def test_the_dashboard_charts_the_history_and_takes_new_samples_and_series_without_a_reload(page, http, node, request):
    # First in this file: the page opens before any model is placed, so the model's series comes later.
    assert http.get("/state").json()["instances"] == {}
    node_name = next(iter(http.get("/state").json()["nodes"].values()))["name"]
    open_with_key(page, node)
    for chart in CHARTS:
        shown(page, node, f'#history figure[data-chart="{chart}"] canvas')
    assert page.locator('#history figure[data-chart="tokens"]').get_attribute("data-series") == ""
    assert page.evaluate("() => { window.sameDocument = true; return true; }")

    placed = request.getfixturevalue("placed")
    ask(http, MAX_TOKENS)
    expected = {"tokens": [TINY_MODEL_ID], "requests": [TINY_MODEL_ID], "queue": [f"{TINY_MODEL_ID} {placed[:8]}"],
                "ttft": ["p50", "p99"], "memory": [f"{node_name} total", f"{node_name} used"]}
    for chart, names in expected.items():
        figure = page.locator(f'#history figure[data-chart="{chart}"]')
        page.wait_for_function("([chart, names]) => document.querySelector(`#history figure[data-chart=${chart}]`)"
                               ".dataset.series === names", arg=[chart, "\n".join(names)], timeout=15_000)
        legend = figure.locator(".u-legend").inner_text()  # drawn by uPlot itself
        assert all(name in legend for name in names), legend
        assert int(figure.get_attribute("data-points")) >= 1
        assert figure.locator("canvas").evaluate("c => c.width") > 0
    last = float(page.locator("#history").get_attribute("data-last"))
    points = int(page.locator('#history figure[data-chart="requests"]').get_attribute("data-points"))
    page.wait_for_function(f"() => +document.getElementById('history').dataset.last > {last}", timeout=15_000)
    assert int(page.locator('#history figure[data-chart="requests"]').get_attribute("data-points")) > points or points == 360
    assert page.evaluate("() => window.sameDocument === true")  # the same page all along: no reload
    assert page.errors == [], what_the_page_saw(page, node)


def test_known_requests_count_exactly_in_the_samples_that_follow_them(http, placed):
    mark = samples(http)[-1]["t"] if samples(http) else 0.0
    mark = next_sample(http, mark)["t"]  # from here on, no request but the ones below
    first_tokens_before = ttft_count(http)
    for _ in range(ASKED):
        assert ask(http, MAX_TOKENS)["usage"]["completion_tokens"] == MAX_TOKENS
    first_tokens = ttft_count(http) - first_tokens_before
    # A sample taken after the last request was answered, so after State saw every task end.
    wait_until(lambda: sum(s["models"][TINY_MODEL_ID]["completion_tokens"] for s in samples(http, mark))
               == ASKED * MAX_TOKENS, 15, 0.2, what="the requests' tokens in the samples")
    next_sample(http, samples(http)[-1]["t"])  # and one more: nothing else comes
    taken = samples(http, mark)

    model = [s["models"][TINY_MODEL_ID] for s in taken]
    assert sum(m["requests"] for m in model) == ASKED
    assert sum(m["completion_tokens"] for m in model) == ASKED * MAX_TOKENS
    assert all(m["requests_per_s"] == m["requests"] / s["interval_s"] and
               m["tokens_per_s"] == m["completion_tokens"] / s["interval_s"] and s["interval_s"] > 0
               for m, s in zip(model, taken, strict=True))
    assert sum(s["ttft"]["count"] for s in taken) == first_tokens  # as /metrics' histogram counted them
    for s in taken:
        ttft = s["ttft"]
        if ttft["count"]:
            assert 0 < ttft["p50_s"] <= ttft["p99_s"] <= 30, ttft
        else:
            assert ttft["p50_s"] is None and ttft["p99_s"] is None, ttft
    assert [s["t"] for s in taken] == sorted(s["t"] for s in taken) and len(taken) <= 360


def test_memory_is_states_by_node_name_and_the_key_is_asked_as_for_metrics(http, node, placed):
    def as_state_says() -> bool:  # a heartbeat may come between the two reads: then read again
        nodes = list(http.get("/state").json()["nodes"].values())
        memory = samples(http)[-1]["memory"]
        return len(nodes) == 1 and memory == {nodes[0]["name"]: {
            "used_bytes": nodes[0]["memory_total"] - nodes[0]["memory_available"],
            "total_bytes": nodes[0]["memory_total"]}} and 0 < nodes[0]["memory_available"] < nodes[0]["memory_total"]
    wait_until(as_state_says, 15, 0.2, what="the latest sample's memory as State's node says it")

    assert httpx.get(f"{node.url}/metrics/history").status_code == 401
    added = http.post("/keys", json={"name": "not-admin"})
    assert added.status_code == 200, added.text
    user = {"Authorization": f"Bearer {added.json()['secret']}"}
    for path in ("/metrics", "/metrics/history"):
        assert httpx.get(f"{node.url}{path}", headers=user).status_code == 403, path


def test_an_open_request_shows_in_its_instances_queue_and_leaves_it(http, node, placed):
    answers: list[httpx.Response] = []
    asking = threading.Thread(target=lambda: answers.append(httpx.post(
        f"{node.url}/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=120,
        json={"model": TINY_MODEL_ID, "max_tokens": LONG, "messages": [{"role": "user", "content": "Go on."}]})))
    asking.start()
    task_id = wait_until(lambda: next((t["task_id"] for t in http.get("/state").json()["tasks"].values()
                                       if t["status"] in ("pending", "running")), None), 30, 0.1,
                         what="the long request's task")
    try:
        wait_until(lambda: samples(http)[-1]["queues"][placed] == {"model_id": TINY_MODEL_ID, "depth": 1}, 10, 0.1,
                   what="a sample with the open request in the queue")
    finally:
        assert http.post(f"/v1/cancel/{task_id}").status_code == 200
        asking.join(60)
    assert answers, "the long request never answered after its cancel"
    wait_until(lambda: samples(http)[-1]["queues"][placed]["depth"] == 0, 10, 0.1, what="the queue empty again")
