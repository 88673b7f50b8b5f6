"""The dashboard on what goes wrong, in headless Chromium against a real `exo` node: an instance
whose download failed shows failed (red, never "running"), and its failed download goes once the
instance does; models are added by local path, and the Add box says what the server said; the
sticky header never covers the chat; the cluster banner is absent while all is well and says in
words what is wrong (a node gone, NATS not answering, an event log without redundancy that other
nodes depend on), the node keeps its card (gone, greyed) and the master is marked. On hand-made
States, in the same page: the page's instance status equals the API's `report_of`, layer bars show a
download's progress and a failure, nodes on one host (and the witness beside its node) have names
that tell them apart, and a log of one replica is said only where other nodes depend on it."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import httpx
import msgspec
import pytest

from exo.api.cluster.instances import report_of
from exo.bus.connection import connect
from exo.bus.server.jetstream_cluster import redundancy
from exo.bus.subjects import event_subject
from exo.core.events import NodeHeartbeat, encode_event
from exo.core.state import State
from exo.core.types import DownloadProgress, Instance, NodeInfo, RunnerInfo, ShardAssignment
from tests.support.cluster import wait_until
from tests.support.dashboard import KEY, chromium_page, exo_node, open_with_key, shown
from tests.support.exo_process import ExoProcess
from tests.support.tiny_model import TINY_MODEL_ID, make_tiny_model

GONE = "exo-test/gone"  # a card whose repository the Hub does not have: its download fails
NODE_TIMEOUT_S = 7  # the master times out a silent node this soon: a node gone costs the test this long


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("model") / "tiny-llama")


@pytest.fixture(scope="module")
def node(tiny, tmp_path_factory):
    with exo_node(tmp_path_factory.mktemp("node"), {TINY_MODEL_ID: tiny}, {"EXO_NODE_TIMEOUT_S": str(NODE_TIMEOUT_S)}) as exo:
        yield exo


@pytest.fixture(scope="module")
def http(node):
    with httpx.Client(base_url=node.url, timeout=120, headers={"Authorization": f"Bearer {KEY}"}) as client:
        yield client


@pytest.fixture
def page(tmp_path, node):
    with chromium_page(tmp_path / "chromium-profile") as page:
        open_with_key(page, node)
        yield page
        assert page.errors == [], page.errors


def color(page, selector: str, prop: str = "color") -> str:
    return page.eval_on_selector(selector, f"e => getComputedStyle(e)[{prop!r}]")


@pytest.mark.slow
def test_a_failed_instance_shows_failed_and_its_failed_download_goes_with_it(page, http):
    assert http.post("/models/add", json={"model_id": TINY_MODEL_ID}).status_code == 200
    card = http.get(f"/v1/models/{TINY_MODEL_ID}").json()["card"]
    added = http.post("/models/add", json=card | {"model_id": GONE, "name": "", "storage_bytes": 1_000_000})
    assert added.status_code == 200, added.text
    placed = http.post("/place_instance", json={"model_id": GONE})
    assert placed.status_code == 200, placed.text
    instance_id = placed.json()["instance_id"]
    wait_until(lambda: http.get(f"/instance/{instance_id}").json()["status"] == "failed", 60, 0.3,
               what="the instance failed")

    shown = page.locator(f'.card.instance[data-instance-id="{instance_id}"]')
    page.wait_for_selector(f'.card.instance[data-instance-id="{instance_id}"][data-status="failed"]')
    assert shown.locator("[data-instance-status]").inner_text() == "failed"
    assert "not_found: download failed:" in shown.locator(".instance-error").inner_text()
    red = color(page, ".instance-error")
    assert color(page, f'.card.instance[data-instance-id="{instance_id}"] [data-instance-status]') == red
    layers = shown.locator(".layers")
    assert layers.get_attribute("data-layers-status") == "failed"
    assert color(page, f'.card.instance[data-instance-id="{instance_id}"] .layers .fill', "backgroundColor") == red
    row = page.locator(f'.model-row[data-model-id="{GONE}"]')
    assert row.locator(".tag[data-instances]").all_inner_texts() == ["1 failed"]
    assert row.locator(".where").inner_text() == "on no node"

    download = page.locator(f'.download[data-model-id="{GONE}"]')
    assert download.get_attribute("data-status") == "failed"  # it tells why the instance failed
    assert http.delete(f"/instance/{instance_id}").status_code == 200
    shown.wait_for(state="detached")
    download.wait_for(state="detached")  # its instance is gone: nothing left to explain
    assert http.get("/state").json()["downloads"][http.get("/node_id").json()][GONE]["status"] == "failed"
    assert http.delete(f"/models/custom/{GONE}").status_code == 200


@pytest.mark.slow
def test_a_model_is_added_by_path_and_the_add_box_says_what_the_server_said(page, http, tiny):
    page.fill("#add-model-path", str(tiny))
    page.click("#add-model-form button[type=submit]")
    row = page.locator('.model-row[data-model-id="local/tiny-llama"]')  # named after its folder
    row.wait_for()
    assert f"local: {tiny}" in row.inner_text() and "2 layers" in row.inner_text()
    assert http.get("/state").json()["custom_model_cards"]["local/tiny-llama"]["path"] == str(tiny)
    assert page.input_value("#add-model-path") == ""

    for model_id, path in (("local/missing", "/no/such/model"), ("exo-test/not-on-the-hub", "")):
        body = {"model_id": model_id, "path": path} if path else {"model_id": model_id}
        answer = http.post("/models/add", json=body)
        assert answer.status_code >= 400
        page.fill("#add-model-id", model_id)
        page.fill("#add-model-path", path)
        page.click("#add-model-form button[type=submit]")
        page.wait_for_selector("#add-model-status.error")
        assert page.inner_text("#add-model-status") == answer.json()["error"]["message"]
        page.fill("#add-model-id", "")
        page.eval_on_selector("#add-model-status", "e => { e.className = ''; }")
    assert http.delete("/models/custom/local/tiny-llama").status_code == 200


@pytest.mark.slow
@pytest.mark.parametrize("width", [390, 700, 1440])
def test_the_sticky_header_never_covers_the_chat(page, width):
    page.set_viewport_size({"width": width, "height": 800})
    page.click('.jump a[href="#chat-panel"]')
    page.wait_for_function("() => location.hash === '#chat-panel'")
    header = page.eval_on_selector(".topbar", "e => e.getBoundingClientRect().bottom")
    title = page.eval_on_selector("#chat-panel h2", "e => e.getBoundingClientRect().top")
    assert title >= header, f"the header ends at {header} px, the chat's title starts at {title} px"
    # What the user sees at the chat's top left is the chat, not the header.
    covered = page.evaluate("""() => {
        const box = document.querySelector('#chat-panel h2').getBoundingClientRect();
        return !document.getElementById('chat-panel').contains(document.elementFromPoint(box.left + 4, box.top + 4));
    }""")
    assert not covered


@pytest.mark.slow
def test_the_banner_says_what_is_wrong_and_a_gone_node_keeps_its_card(page, http, node):
    this = http.get("/node_id").json()
    shown(page, node, '#banner[data-health="ok"]', "attached")  # /health asked and answered
    assert page.eval_on_selector("#banner", "e => e.hidden") and page.locator("#banner [data-trouble]").count() == 0
    assert http.get("/state").json()["leader_node"] == this
    assert page.locator(".card.node .tag.master").count() == 1
    assert page.locator(f'.card.node[data-node-id="{this}"] .tag.master').inner_text() == "master"

    # A node that registers and then falls silent: the master times it out, the page keeps it.
    ghost = uuid.uuid4().hex
    with ThreadPoolExecutor(1) as thread:  # Playwright's sync API holds this thread's event loop
        thread.submit(asyncio.run, _describe(node, ghost, "studio")).result()
    card = f'.card.node[data-node-id="{ghost}"]'
    shown(page, node, f'{card}[data-node-state="live"]')
    # Two nodes now depend on this node's log of one replica: that is the banner's one line.
    assert _banner_line(page, node, "redundancy", present=True).startswith("This cluster has no redundancy: ")
    assert page.locator("#banner [data-trouble]").count() == 1
    page.locator(f'{card}[data-node-state="gone"]').wait_for(timeout=(NODE_TIMEOUT_S + 15) * 1000)
    assert ghost not in http.get("/state").json()["nodes"]
    at = r"at \d{1,2}:\d\d:\d\d(\s?[AP]M)?"
    assert re.fullmatch(f"gone {at}: timed out: no heartbeat for {NODE_TIMEOUT_S} s",
                        page.locator(f"{card} .liveness").inner_text()), page.locator(f"{card} .liveness").inner_text()
    assert page.locator(f"{card} .node-name").inner_text() == "studio"
    assert color(page, card, "filter") == "grayscale(1)"
    gone_line = page.locator('#banner [data-trouble="gone"]').inner_text()
    assert re.fullmatch(f"Node studio is gone \\(timed out: no heartbeat for {NODE_TIMEOUT_S} s, {at}\\): check that "
                        "it runs and can reach the others; it rejoins by itself when it does.", gone_line), gone_line
    assert page.locator('#banner [data-trouble="redundancy"]').count() == 0  # alone again: nothing else to stop
    page.wait_for_timeout(1500)  # State fetched again without it: still listed
    assert page.locator(f'{card}[data-node-state="gone"]').count() == 1
    assert page.locator(f'.card.node[data-node-id="{this}"] .tag.master').count() == 1

    # This node's NATS server stops answering: /health says so, and the banner with it.
    with _paused(_nats_server_of(node)):
        health = _banner_line(page, node, "health", present=True)
    assert health.startswith("This node cannot serve requests: JetStream cannot serve EXO_EVENTS: "), health
    assert health.endswith(". NATS does not answer in time: check this node's NATS server (its log, CPU and disk)."), health
    _banner_line(page, node, "health", present=False)  # answering again: the line goes


async def _describe(node: ExoProcess, node_id: str, name: str) -> None:
    """A node's first description, as its heartbeat writes it; no pulse follows (no memory: no placement picks it)."""
    nc = await connect([node.nats_url()], name="test-ghost")
    try:
        event = NodeHeartbeat(node=NodeInfo(node_id=node_id, name=name, hostname=name, last_seen=time.time()))
        await nc.jetstream().publish(event_subject("node.heartbeat"), encode_event(event), timeout=5)
    finally:
        await nc.close()


def _nats_server_of(node: ExoProcess) -> int:
    assert node.process is not None
    for pid in map(int, filter(str.isdigit, os.listdir("/proc"))):
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes()
            parent = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError):
            continue
        if parent == node.process.pid and b"nats-server" in command:
            return pid
    raise AssertionError(f"no nats-server under exo (pid {node.process.pid})")


@contextmanager
def _paused(pid: int) -> Iterator[None]:
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def _banner_line(page, node: ExoProcess, trouble: str, present: bool) -> str:
    """Wait until the banner has (or has not) the line `trouble`, showing the page again (a visible
    page asks /health at once) instead of waiting for its next look."""
    line = page.locator(f'#banner [data-trouble="{trouble}"]')
    deadline = time.monotonic() + 20
    while (line.count() > 0) != present:
        assert time.monotonic() < deadline, f"banner line {trouble} never {'shown' if present else 'gone'}"
        page.evaluate("document.dispatchEvent(new Event('visibilitychange'))")
        page.wait_for_timeout(500)
    return line.inner_text() if present else ""


# -- hand-made States, drawn by the page's own modules -----------------------------------------

MODEL = "org/model"


def two_ranks(a: str | None, b: str | None, downloads: list[DownloadProgress] = ()) -> State:
    instance = Instance(instance_id="i1", model_id=MODEL, shards=[
        ShardAssignment(runner_id="r0", node_id="a", rank=0, world_size=2, start_layer=0, end_layer=4),
        ShardAssignment(runner_id="r1", node_id="b", rank=1, world_size=2, start_layer=4, end_layer=8)])
    runners = {rid: RunnerInfo(runner_id=rid, instance_id="i1", node_id=node, status=status)  # type: ignore[arg-type]
               for rid, node, status in (("r0", "a", a), ("r1", "b", b)) if status is not None}
    found: dict = {}
    for record in downloads:
        found.setdefault(record.node_id, {})[record.model_id] = record
    nodes = {node: NodeInfo(node_id=node, hostname=f"host-{node}") for node in ("a", "b")}
    return State(nodes=nodes, instances={"i1": instance}, runners=runners, downloads=found)


DRAW = """async (state) => {
    const [{renderNodes}, {renderReplicas}, {renderInstances}, {instanceStatus}] = await Promise.all(
        ["cluster", "replicas", "instances", "status"].map((m) => import(`/dashboard/${m}.js`)));
    const box = document.createElement("div");
    box.id = "drawn";
    document.getElementById("drawn")?.remove();
    document.body.append(box);
    const ctx = {nodeId: null, rates: null, toast: () => {}};
    for (const draw of [renderNodes, renderReplicas, renderInstances]) {
        const part = document.createElement("div");
        box.append(part);
        draw(part, state, ctx);
    }
    return state.instances.i1 ? instanceStatus(state.instances.i1, state) : null;
}"""


def draw(page, state: State) -> str:
    return page.evaluate(DRAW, msgspec.to_builtins(state))


@pytest.mark.slow
def test_the_page_says_the_status_report_of_says(page):
    statuses = ["created", "downloading", "downloaded", "loading", "warming_up", "ready", "stopped", "failed", None]
    for a in statuses:
        for b in statuses:
            state = two_ranks(a, b)
            assert draw(page, state) == report_of(state, state.instances["i1"]).status, (a, b)


@pytest.mark.slow
def test_layer_bars_show_a_download_under_way_and_a_failure(page):
    state = two_ranks("downloading", "failed", [
        DownloadProgress(node_id="a", model_id=MODEL, status="downloading", done_bytes=40, total_bytes=100, eta_s=30),
        DownloadProgress(node_id="b", model_id=MODEL, status="failed", error_code="not_found", error="gone")])
    draw(page, state)
    going = page.locator('#drawn .card.instance tr[data-rank="0"]')
    bar = going.locator(".layers")
    assert (bar.get_attribute("data-layers-status"), bar.get_attribute("data-progress")) == ("downloading", "40")
    assert bar.locator(".fill").evaluate("e => e.style.width") == "40%"
    assert "downloading 40% · 40 B of 100 B · 30 s left" in going.inner_text()
    failed = page.locator('#drawn .card.instance tr[data-rank="1"]')
    assert failed.locator(".layers").get_attribute("data-layers-status") == "failed"
    red = color(page, '#drawn .card.instance tr[data-rank="1"] .error')
    assert color(page, '#drawn .card.instance tr[data-rank="1"] .layers .fill', "backgroundColor") == red
    assert page.locator("#drawn .card.instance").get_attribute("data-status") == "failed"
    # A node's shard shows the same bars.
    assert page.locator('#drawn .card.node[data-node-id="a"] .layers').get_attribute("data-progress") == "40"


@pytest.mark.slow
def test_nodes_on_one_host_and_the_witness_have_names_that_tell_them_apart(page):
    seed, second, old_a, old_b = "5eed0000aaaa", "5ec0000dbbbb", "01d0000acccc", "01d0000bdddd"
    nodes = {seed: NodeInfo(node_id=seed, hostname="vm", name="vm"),
             second: NodeInfo(node_id=second, hostname="vm", name="vm:52416"),
             old_a: NodeInfo(node_id=old_a, hostname="box"),  # older nodes: no name, one hostname
             old_b: NodeInfo(node_id=old_b, hostname="box")}
    layout = {"name": "exo", "meta_leader": f"exo-{seed}", "streams": [],
              "servers": [{"name": f"exo-{seed}", "online": True}, {"name": f"exo-{seed}-witness", "online": True},
                          {"name": f"exo-{second}", "online": False}]}
    state = msgspec.to_builtins(State(nodes=nodes)) | {"cluster": layout}
    page.evaluate(DRAW, state)
    names = page.locator("#drawn .card.node .node-name").all_inner_texts()
    assert sorted(names) == ["box (01d0000a)", "box (01d0000b)", "vm", "vm:52416"]
    servers = page.locator("#drawn [data-server]").all_inner_texts()
    assert servers == ["vm ★", "vm witness", "vm:52416 offline"]


TROUBLES = """async ({state, events, health}) => {
    const [{renderNodes}, {Troubles, renderBanner}] = await Promise.all(
        ["cluster", "banner"].map((m) => import(`/dashboard/${m}.js`)));
    const troubles = new Troubles();
    troubles.health = health || null;
    for (const event of events) troubles.noteEvent(event, state, true);
    document.getElementById("drawn")?.remove();
    const box = document.createElement("div");
    box.id = "drawn";
    document.body.append(box);
    const [nodes, banner] = [document.createElement("div"), document.createElement("div")];
    banner.className = "banner"; // styled as the page's own
    box.append(nodes, banner);
    renderNodes(nodes, state, {nodeId: null, troubles});
    renderBanner(banner, state, troubles, null);
}"""


@pytest.mark.slow
def test_a_suspect_node_an_offline_server_and_a_stream_short_of_replicas_are_said(page):
    # State holds the master's marks (suspect_since); the page knows a's reason from its node.suspect
    # event, c's (a node running no instance) only from State.
    state = two_ranks("ready", "ready")
    nodes = {**state.nodes, "a": msgspec.structs.replace(state.nodes["a"], suspect_since=1000.0),
             "c": NodeInfo(node_id="c", hostname="host-c", suspect_since=2000.0)}
    layout = {"name": "exo", "meta_leader": "exo-a",
              "servers": [{"name": "exo-a", "online": True}, {"name": "exo-b", "online": False}],
              "streams": [{"name": "EXO_EVENTS", "replicas": 3, "leader": "exo-a", "followers": ["exo-b"]}]}
    suspect = {"seq": 9, "kind": "node.suspect",
               "data": {"node_id": "a", "suspect": True, "reason": "node host-a is suspect: no pulse for 5 s", "at": 1000.0}}
    page.evaluate(TROUBLES, {"state": msgspec.to_builtins(msgspec.structs.replace(state, nodes=nodes)) | {"cluster": layout},
                             "events": [suspect]})
    states = {n: page.locator(f'#drawn .card.node[data-node-id="{n}"]').get_attribute("data-node-state") for n in "abc"}
    assert states == {"a": "suspect", "b": "offline", "c": "suspect"}
    assert page.locator('#drawn .card.node[data-node-id="a"] .liveness').inner_text() == "suspect: no pulse for 5 s"
    since = page.evaluate("new Date(2000 * 1000).toLocaleTimeString()")
    assert page.locator('#drawn .card.node[data-node-id="c"] .liveness').inner_text() == f"suspect: no pulse since {since}"
    lines = page.locator("#drawn [data-trouble]")
    assert [(line.get_attribute("data-trouble"), line.inner_text()) for line in lines.all()] == [
        ("suspect", "Node host-a is suspect: no pulse for 5 s; its requests moved to other nodes. "
                    "Check that it runs and can reach the others."),
        ("suspect", f"Node host-c is suspect: no pulse since {since}; its requests moved to other nodes. "
                    "Check that it runs and can reach the others."),
        ("server", "The NATS server of host-b is offline: check that the node runs and can reach the others."),
        ("stream", "Stream EXO_EVENTS has 1 of its 3 replicas online: without a majority it takes no writes. "
                   "Start the stopped nodes.")]


@pytest.mark.slow
def test_the_banner_says_when_other_nodes_depend_on_an_event_log_without_redundancy(page, http, node):
    # This lone node's log has one replica and /health says so, but losing its server stops nothing else: no line.
    shown(page, node, '#banner[data-health="ok"]', "attached")
    assert http.get("/health").json()["redundancy"] == redundancy(1)
    assert page.locator('#banner [data-trouble="redundancy"]').count() == 0

    # Two nodes on a log of one replica (a node started with --nats, issue #46): the line, and its fix.
    state = msgspec.to_builtins(two_ranks("ready", "ready"))
    page.evaluate(TROUBLES, {"state": state, "events": [], "health": {"status": "ok", "redundancy": redundancy(1)}})
    lines = page.locator("#drawn [data-trouble]")
    assert [(line.get_attribute("data-trouble"), line.inner_text()) for line in lines.all()] == [
        ("redundancy", "This cluster has no redundancy: the event log has 1 replica, and losing its NATS server stops "
                       "the cluster; fix: run three nodes as members of one exo cluster (--join HOST:PORT or "
                       "discovery) instead of --nats, or a three-server NATS cluster with EXO_REPLICAS=3 "
                       "(docs/deploy.md).")]
    page.eval_on_selector("#drawn [data-trouble]", "e => e.insertAdjacentHTML('afterend', "
                          "'<p data-trouble=stream></p><p data-trouble=health></p>')")
    warned, stream, health = (color(page, f'#drawn [data-trouble="{kind}"]', "backgroundColor")
                              for kind in ("redundancy", "stream", "health"))
    assert warned == stream != health  # a risk: warned as a stream short of replicas is, not red

    # The same two nodes on a log of three replicas: nothing to say.
    page.evaluate(TROUBLES, {"state": state, "events": [], "health": {"status": "ok", "redundancy": redundancy(3)}})
    assert page.locator("#drawn [data-trouble]").count() == 0
