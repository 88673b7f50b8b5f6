"""One node end to end: `exo` as a separate process, the official openai client, the tiny model
downloaded from a local imitation of the Hub, and text compared with mlx-lm's own output."""

from __future__ import annotations

import asyncio
import json
import re
import time
from pathlib import Path

import httpx
import mlx_lm
import openai
import pytest

from exo.bus.connection import connect
from exo.bus.token_stream import TokenListener
from exo.core.requests import TokenChunk
from tests.support.cluster import wait_until
from tests.support.e2e import Reference
from tests.support.exo_process import ExoProcess
from tests.support.fake_hub import FakeHub
from tests.support.tiny_model import TINY_MODEL_ID, make_tiny_model

pytestmark = pytest.mark.slow

MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Tell me about the sea."}]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("model") / "tiny-llama")


@pytest.fixture(scope="module")
def hub(tiny_model: Path):
    fake = FakeHub({TINY_MODEL_ID: tiny_model})
    fake.start()
    yield fake
    fake.stop()


@pytest.fixture(scope="module")
def expected(tiny_model: Path) -> dict:
    """What mlx-lm itself generates for the same model and prompt, greedily."""
    model, tokenizer = mlx_lm.load(str(tiny_model))
    prompt = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    text = mlx_lm.generate(model, tokenizer, prompt, max_tokens=MAX_TOKENS)
    assert len(text) > 2 * MAX_TOKENS // 3 and len(set(text)) > 5  # real text to compare, not a degenerate one
    return {"text": text, "prompt_tokens": len(tokenizer.encode(prompt, add_special_tokens=False))}


@pytest.fixture(scope="module")
def node(tmp_path_factory, hub: FakeHub):
    root = tmp_path_factory.mktemp("node")
    # On-demand placement off: this module's 503s for a model with no instance (tests/test_on_demand.py has it on).
    env = {"HF_ENDPOINT": hub.endpoint, "HF_HOME": str(root / "hf"), "HF_HUB_DISABLE_TELEMETRY": "1",
           "EXO_ON_DEMAND": "0"}
    exo = ExoProcess(root / "data", env).start()
    yield exo
    if exo.process.poll() is None:
        exo.interrupt()


@pytest.fixture(scope="module")
def http(node: ExoProcess):
    with httpx.Client(base_url=node.url, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def client(node: ExoProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{node.url}/v1", api_key="unused", timeout=120, max_retries=0)


@pytest.fixture(scope="module")
def instance_id(http: httpx.Client, node: ExoProcess, hub: FakeHub) -> str:
    added = http.post("/models/add", json={"model_id": TINY_MODEL_ID})
    assert added.status_code == 200, added.text
    assert added.json()["card"]["n_layers"] == 2
    placed = http.post("/place_instance", json={"model_id": TINY_MODEL_ID})
    assert placed.status_code == 200, placed.text
    return placed.json()["instance_id"]


def test_chat_equals_mlx_lm_exactly(client, instance_id, expected, hub):
    reply = client.chat.completions.create(
        model=TINY_MODEL_ID, messages=MESSAGES, temperature=0, max_tokens=MAX_TOKENS
    )
    assert reply.choices[0].message.content == expected["text"]
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage.completion_tokens == MAX_TOKENS
    assert reply.usage.prompt_tokens == expected["prompt_tokens"]
    assert hub.downloads[f"{TINY_MODEL_ID}/model.safetensors"] == 1  # the real download path ran


def test_streaming_equals_mlx_lm_exactly(client, instance_id, expected):
    stream = client.chat.completions.create(
        model=TINY_MODEL_ID, messages=MESSAGES, temperature=0, max_tokens=MAX_TOKENS,
        stream=True, stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected["text"]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == MAX_TOKENS
    assert len({c.id for c in chunks}) == 1


def test_stop_strings_cut_the_text(client, instance_id, expected):
    stop = expected["text"][10:13]
    cut = expected["text"].index(stop)
    reply = client.chat.completions.create(
        model=TINY_MODEL_ID, messages=MESSAGES, temperature=0, max_tokens=MAX_TOKENS, stop=[stop]
    )
    assert reply.choices[0].message.content == expected["text"][:cut]
    assert reply.choices[0].finish_reason == "stop"


def test_sampling_with_a_seed_equals_mlx_lm_with_that_seed(client, instance_id, tiny_model):
    def sample(seed: int) -> str:
        reply = client.chat.completions.create(
            model=TINY_MODEL_ID, messages=MESSAGES, temperature=1.5, top_p=0.95, seed=seed, max_tokens=16
        )
        return reply.choices[0].message.content

    reference = Reference(tiny_model)
    for seed in (7, 8):
        assert sample(seed) == reference.sampled_chat(MESSAGES, 16, seed=seed, temperature=1.5, top_p=0.95)
    assert sample(7) != sample(8)  # the seed is used, not ignored


def test_a_client_that_disconnects_cancels_its_generation(http, node, instance_id):
    body = {"model": TINY_MODEL_ID, "messages": MESSAGES, "max_tokens": 30_000, "stream": True}  # the card's context: 32768
    with http.stream("POST", "/v1/chat/completions", json=body) as response:
        lines = response.iter_lines()
        first = [line for line in (next(lines) for _ in range(12)) if line.startswith("data: ")]
    task_id = json.loads(first[0].removeprefix("data: "))["id"].removeprefix("chatcmpl-")

    def cancelled_task() -> dict | None:
        task = http.get("/state").json()["tasks"].get(task_id, {})
        return task if task.get("status") == "cancelled" else None

    task = wait_until(cancelled_task, 30, what=f"task {task_id} cancelled")
    assert 0 < task["completion_tokens"] < 30_000


def test_a_late_listener_replays_every_chunk_from_jetstream(client, node, instance_id, expected):
    reply = client.chat.completions.create(model=TINY_MODEL_ID, messages=MESSAGES, temperature=0, max_tokens=MAX_TOKENS)
    command_id = reply.id.removeprefix("chatcmpl-")
    nats_url = node.nats_url()

    async def replay() -> list[TokenChunk]:
        nc = await connect([nats_url], name="late-listener")
        listener = await TokenListener.from_stream(nc, command_id)
        chunks = [await asyncio.wait_for(listener.queue.get(), 10)]
        while chunks[-1].finish_reason is None:
            chunks.append(await asyncio.wait_for(listener.queue.get(), 10))
        await nc.close()
        return chunks

    chunks = asyncio.run(replay())
    assert "".join(c.text for c in chunks) == expected["text"]
    assert [c.index for c in chunks] == list(range(len(chunks)))
    assert chunks[-1].finish_reason == "length" and chunks[-1].token_count == MAX_TOKENS


def test_a_card_can_point_at_a_local_model_directory_and_deleting_its_instance_ends_its_stream(
    http, client, tiny_model, expected, instance_id
):
    added = http.post("/models/add", json={"model_id": "local/tiny", "path": str(tiny_model)})
    assert added.status_code == 200, added.text
    local_instance = http.post("/place_instance", json={"model_id": "local/tiny"}).json()["instance_id"]
    reply = client.chat.completions.create(model="local/tiny", messages=MESSAGES, temperature=0, max_tokens=MAX_TOKENS)
    assert reply.choices[0].message.content == expected["text"]

    body = {"model": "local/tiny", "messages": MESSAGES, "max_tokens": 30_000, "stream": True}  # the card's context: 32768
    with http.stream("POST", "/v1/chat/completions", json=body) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("id: ") and next(lines).startswith("data: {")
        assert http.delete(f"/instance/{local_instance}").status_code == 200
        started = time.monotonic()
        rest = [line for line in lines if line]
    assert time.monotonic() - started < 15
    assert any('"error"' in line for line in rest) and rest[-1] == "data: [DONE]"
    assert http.delete("/models/custom/local/tiny").status_code == 200


@pytest.mark.parametrize(
    ("method", "path", "body", "status"),
    [
        ("POST", "/v1/chat/completions", b"{not json", 400),
        ("POST", "/v1/chat/completions", b"", 400),
        ("POST", "/v1/chat/completions", {"model": TINY_MODEL_ID}, 400),
        ("POST", "/v1/chat/completions", {"model": TINY_MODEL_ID, "messages": []}, 400),
        ("POST", "/v1/chat/completions", {"model": TINY_MODEL_ID, "messages": MESSAGES, "n": 17}, 400),
        ("POST", "/v1/chat/completions", {"model": TINY_MODEL_ID, "messages": MESSAGES, "temperature": 9}, 400),
        ("POST", "/v1/chat/completions", {"model": TINY_MODEL_ID, "messages": [{"role": "wizard", "content": "x"}]}, 400),
        ("POST", "/v1/chat/completions", {"model": "nobody/nothing", "messages": MESSAGES}, 404),
        ("POST", "/v1/chat/completions", {"model": "mlx-community/Qwen3-0.6B-4bit", "messages": MESSAGES}, 503),
        ("DELETE", "/instance/no-such-instance", None, 404),
        ("GET", "/instance/no-such-instance", None, 404),
        ("POST", "/place_instance", {"model_id": "nobody/nothing"}, 404),
        ("POST", "/place_instance", {"model_id": TINY_MODEL_ID, "sharding": "diagonal"}, 400),
        ("POST", "/models/add", {"model_id": "../../escaped"}, 400),
        ("POST", "/models/add", {"model_id": "/etc/passwd"}, 400),
        ("POST", "/models/add", {"model_id": "org/x", "path": "/nonexistent/dir"}, 400),
        ("POST", "/models/add", {"model_id": "nobody/missing-repo"}, 404),
        ("POST", "/models/add", {"model_id": "org/typo", "n_layer": 3}, 400),
        ("DELETE", "/models/custom/..%2F..%2Fescaped", None, 400),
        ("DELETE", "/models/custom/nobody/nothing", None, 404),
        ("DELETE", "/models/custom/mlx-community/Qwen3-0.6B-4bit", None, 409),
        ("GET", "/no/such/route", None, 404),
    ],
)
def test_bad_input_gets_an_openai_style_error_and_the_node_keeps_serving(http, node, instance_id, method, path, body, status):
    content = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    response = http.request(method, path, content=content, headers={"Content-Type": "application/json"})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["message"] and error["type"]
    assert http.get("/health").json()["status"] == "ok"
    written = {p.name for p in node.data_dir.parent.rglob("*escaped*")} | {p.name for p in Path("/").glob("escaped*")}
    assert written == set()


def test_state_node_id_and_models(http, node, instance_id):
    state = http.get("/state").json()
    node_id = http.get("/node_id").json()
    assert node_id in state["nodes"]
    assert state["instances"][instance_id]["model_id"] == TINY_MODEL_ID
    (runner,) = [r for r in state["runners"].values() if r["instance_id"] == instance_id]
    assert runner["status"] == "ready" and runner["node_id"] == node_id
    ids = [m["id"] for m in http.get("/v1/models").json()["data"]]
    assert TINY_MODEL_ID in ids and "mlx-community/Llama-3.2-1B-Instruct-4bit" in ids
    card_file = node.data_dir / "custom_cards" / "exo-test--tiny-llama.toml"
    assert f'model_id = "{TINY_MODEL_ID}"' in card_file.read_text()


def test_the_ready_line_says_what_the_runners_warm_up_took(node, instance_id):
    """The runner times its warm-up (greedy and sampled kernels: tests/test_warm_up.py), the worker
    puts it in the ready status, and the master's INFO line says it."""
    ready = re.compile(rf"master: {TINY_MODEL_ID} ready on .+ in \d+\.\d s from placement "
                       rf"\(instance {instance_id}, warm-up (\d+\.\d\d) s\)$")
    found = wait_until(lambda: next(filter(None, map(ready.search, node.output().splitlines())), None), 60,
                       what="the instance's ready line")
    assert float(found.group(1)) > 0


def test_forged_elections_do_not_wedge_the_cluster(http, client, node, instance_id, expected):
    """A stray publisher's leader.elected, with a huge term of the old scheme or as a new-scheme
    election, displaces the master for a moment at most: it elects itself again and serves."""
    nats_url = node.nats_url()
    node_id = http.get("/node_id").json()
    before = http.get("/state").json()["last_seq"]

    async def forge() -> None:
        nc = await connect([nats_url], name="forger")
        js = nc.jetstream()
        await js.publish("exo.events.leader.elected", b'{"kind":"leader.elected","node_id":"attacker","term":1000000000000}')
        await js.publish("exo.events.leader.elected", b'{"kind":"leader.elected","node_id":"attacker","lease_revision":1}')
        await nc.close()

    asyncio.run(forge())

    def leading_again() -> bool:
        state = http.get("/state").json()
        return state["leader_node"] == node_id and state["last_seq"] > before + 2

    try:  # well within the lease's TTL of 10 s plus a campaign
        wait_until(leading_again, 15, 0.2, what=f"{node_id} leading again after the forged elections")
    except AssertionError as timed_out:
        raise AssertionError(f"{timed_out}; the leader: {http.get('/state').json()['leader_node']}") from None
    reply = client.chat.completions.create(model=TINY_MODEL_ID, messages=MESSAGES, temperature=0, max_tokens=MAX_TOKENS)
    assert reply.choices[0].message.content == expected["text"]
    # No re-campaign storm: a handful of elections, not hundreds a second.
    time.sleep(2)
    state = http.get("/state").json()
    elections = [s for s in state["skipped_events"] if s["seq"] > before]
    assert len(elections) <= 3 and state["last_seq"] - before < 60, (elections, state["last_seq"] - before)


def test_zz_delete_instance_then_card_then_ctrl_c_stops_cleanly(http, client, node, instance_id):
    assert http.delete(f"/instance/{instance_id}").status_code == 200
    with pytest.raises(openai.APIStatusError) as unavailable:
        client.chat.completions.create(model=TINY_MODEL_ID, messages=MESSAGES, max_tokens=4)
    assert unavailable.value.status_code == 503
    assert http.delete(f"/models/custom/{TINY_MODEL_ID}").status_code == 200
    card_file = node.data_dir / "custom_cards" / "exo-test--tiny-llama.toml"
    wait_until(lambda: not card_file.exists(), 10, 0.05, what=f"{card_file} deleted")
    assert node.interrupt() == 0
    assert "exo: stopping" in node.output()
    assert "Server Exiting" in (node.data_dir / "nats" / "nats-server.log").read_text()
