"""LoRA adapters shared by hash: an adapter uploaded (or added from the Hub) is checked against its
base model, stored in exo-adapters under its sha256, fetched and verified by the node that loads
it, and serves exactly mlx-lm's text with that adapter loaded (`mlx_lm.load(adapter_path=...)`),
beside its base model's own instance; what does not fit, or is corrupt, is refused with the reason."""

from __future__ import annotations

import asyncio
import hashlib
import json
from pathlib import Path

import httpx
import mlx.core as mx
import msgspec
import numpy as np
import openai
import pytest

from exo.bus.connection import connect
from exo.bus.subjects import ADAPTERS_BUCKET
from exo.core.adapters import Adapter, misfit, read_adapter, safetensors_header, split_adapter_id
from exo.core.commands import AddAdapter, DeleteAdapter
from exo.core.events import AdapterAdded, CommandRejected
from exo.core.state import State
from exo.core.types import Instance, ModelCard
from exo.master.decide import decide
from tests.support.adapters import make_adapter
from tests.support.e2e import Reference, exo_serving, nats_url_of, place
from tests.support.tiny_model import TINY_MODEL_ID, Dims, make_tiny_model

ADAPTER_REPO = "exo-test/tiny-pirate-lora"
ASK = [{"role": "user", "content": "Tell me about the sea."}]
CARD = ModelCard(model_id=TINY_MODEL_ID, n_layers=2, hidden_size=64)


def _files(folder: Path) -> tuple[bytes, bytes]:
    return (folder / "adapter_config.json").read_bytes(), (folder / "adapters.safetensors").read_bytes()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("model") / "tiny")


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory, model_dir):
    return make_adapter(model_dir, tmp_path_factory.mktemp("adapter") / "pirate")


@pytest.fixture(scope="module")
def foreign_adapter(tmp_path_factory):
    """An adapter trained for another model: hidden size 32, not the tiny model's 64."""
    other = make_tiny_model(tmp_path_factory.mktemp("other") / "m", Dims(hidden=32, intermediate=64, heads=2, kv_heads=1))
    return make_adapter(other, tmp_path_factory.mktemp("foreign") / "a")


@pytest.fixture(scope="module")
def narrow_kv_adapter(tmp_path_factory):
    """An adapter for a model of the tiny one's hidden size but one key/value head, not two: its
    lora_a fit, its k_proj and v_proj lora_b are 16 wide where the tiny model's need 32."""
    other = make_tiny_model(tmp_path_factory.mktemp("narrow") / "m", Dims(heads=4, kv_heads=1))
    return make_adapter(other, tmp_path_factory.mktemp("narrow_kv") / "a")


@pytest.fixture(scope="module")
def poisoned_adapter(tmp_path_factory, adapter_dir):
    """The pirate adapter with one NaN in one tensor."""
    weights = mx.load(str(adapter_dir / "adapters.safetensors"))
    name = "model.layers.1.self_attn.v_proj.lora_b"
    weights[name] = mx.where(mx.arange(weights[name].size).reshape(weights[name].shape) == 5, mx.nan, weights[name])
    out = tmp_path_factory.mktemp("poisoned") / "a"
    out.mkdir()
    mx.save_safetensors(str(out / "adapters.safetensors"), weights)
    (out / "adapter_config.json").write_bytes((adapter_dir / "adapter_config.json").read_bytes())
    return out


def _adapter(adapter_dir: Path, name: str = "pirate") -> Adapter:
    config, weights = _files(adapter_dir)
    facts = read_adapter(config, weights)
    assert not isinstance(facts, str), facts
    return Adapter(name=name, base_model=TINY_MODEL_ID, digest=hashlib.sha256(weights).hexdigest(), size=len(weights),
                   config=config.decode(), **msgspec.structs.asdict(facts))


# --- the pure checks ---

def test_the_files_mlx_lm_writes_are_read_as_what_they_are(adapter_dir, foreign_adapter):
    adapter = _adapter(adapter_dir)
    assert (adapter.fine_tune_type, adapter.rank, adapter.layers, adapter.hidden_inputs) == ("lora", 4, 2, [64])
    assert misfit(adapter, CARD) is None
    foreign = _adapter(foreign_adapter)
    assert f"inputs 32 wide, but {TINY_MODEL_ID}'s hidden size is 64" in (misfit(foreign, CARD) or "")
    assert "changes layer 1, but" in (misfit(adapter, msgspec.structs.replace(CARD, n_layers=1)) or "")
    assert split_adapter_id(adapter.model_id) == (TINY_MODEL_ID, "pirate")
    assert split_adapter_id(TINY_MODEL_ID) == (TINY_MODEL_ID, "")


def _header(tensors: dict, body: bytes = b"") -> bytes:
    raw = json.dumps(tensors).encode()
    return len(raw).to_bytes(8, "little") + raw + body


CONFIG = json.dumps({"num_layers": 2, "lora_parameters": {"rank": 4, "scale": 20.0}}).encode()
GOOD = {"layers.0.q_proj.lora_a": {"dtype": "F32", "shape": [64, 4], "data_offsets": [0, 1024]}}


@pytest.mark.parametrize(("config", "weights", "reason"), [
    (CONFIG, b"\x01\x02", "too short"),
    (CONFIG, (10**9).to_bytes(8, "little") + b"{}", "its header claims 1000000000 bytes"),
    (CONFIG, _header(GOOD, bytes(1000)), "outside the file's 1000 bytes"),
    (CONFIG, _header({"layers.0.q_proj.lora_a": {**GOOD["layers.0.q_proj.lora_a"], "shape": [64, 5]}}, bytes(1024)),
     "needs 1280 bytes"),
    (CONFIG, _header({"layers.0.q_proj.weight": GOOD["layers.0.q_proj.lora_a"]}, bytes(1024)), "is not a LoRA parameter"),
    (CONFIG.replace(b'"rank": 4', b'"rank": 8'), _header(GOOD, bytes(1024)), "has rank 4, its config says 8"),
    (CONFIG, _header({"layers.0.q_proj.lora_b": {**GOOD["layers.0.q_proj.lora_a"], "shape": [8, 32]}}, bytes(1024)),
     "layers.0.q_proj.lora_b has rank 8, its config says 4"),
    (b"not json", _header(GOOD, bytes(1024)), "adapter_config.json is not JSON"),
    (json.dumps({"fine_tune_type": "full", "num_layers": 2}).encode(), _header(GOOD, bytes(1024)), "'full' is not served"),
    (CONFIG.replace(b'"rank": 4', b'"rank": true'), _header(GOOD, bytes(1024)), "rank must be between"),
    (CONFIG, _header({}), "holds no tensors"),
])
def test_files_that_are_not_an_mlx_lm_lora_adapter_are_refused_with_the_reason(config, weights, reason):
    found = read_adapter(config, weights)
    assert isinstance(found, str) and reason in found, found


# One lora_a of 256 values, all 0.0 but the last: (dtype, numpy type, the last value's bits).
NON_FINITE = [("F32", "<u4", 0x7FC00000), ("F32", "<u4", 0x7F800000), ("F32", "<u4", 0xFF800000),
              ("F16", "<u2", 0x7E00), ("F16", "<u2", 0x7C00), ("F16", "<u2", 0xFC00),
              ("BF16", "<u2", 0x7FC0), ("BF16", "<u2", 0x7F80), ("BF16", "<u2", 0xFF80)]
LARGEST = [("F32", "<u4", 0x7F7FFFFF), ("F32", "<u4", 0xFF7FFFFF), ("F16", "<u2", 0x7BFF), ("BF16", "<u2", 0x7F7F),
           ("BF16", "<u2", 0xFF7F)]


def _one_tensor(dtype: str, kind: str, last_bits: int) -> bytes:
    values = np.zeros(256, dtype=kind)
    values[-1] = last_bits
    spec = {"dtype": dtype, "shape": [64, 4], "data_offsets": [0, values.nbytes]}
    return _header({"layers.0.q_proj.lora_a": spec}, values.tobytes())


@pytest.mark.parametrize(("dtype", "kind", "bits"), NON_FINITE)
def test_a_tensor_holding_nan_or_infinity_is_refused_naming_it(dtype, kind, bits):
    assert read_adapter(CONFIG, _one_tensor(dtype, kind, bits)) == (
        "adapters.safetensors: layers.0.q_proj.lora_a holds NaN or infinite values: every logit of the model would be NaN")


@pytest.mark.parametrize(("dtype", "kind", "bits"), LARGEST)
def test_the_largest_finite_values_are_not_taken_for_infinity(dtype, kind, bits):
    assert not isinstance(read_adapter(CONFIG, _one_tensor(dtype, kind, bits)), str)


def test_lora_b_widths_are_checked_against_the_base_models_card(adapter_dir, narrow_kv_adapter, poisoned_adapter):
    card = msgspec.structs.replace(CARD, num_attention_heads=4, num_key_value_heads=2)
    assert not isinstance(read_adapter(*_files(adapter_dir), card), str)
    assert read_adapter(*_files(narrow_kv_adapter), card) == (
        f"adapters.safetensors: model.layers.0.self_attn.k_proj.lora_b is [4, 16], but {TINY_MODEL_ID} needs [4, 32]: "
        "it was trained for another model")
    assert misfit(_adapter(narrow_kv_adapter), card) is None  # its lora_a fit: only lora_b tells
    assert read_adapter(*_files(poisoned_adapter), card) == (
        "adapters.safetensors: model.layers.1.self_attn.v_proj.lora_b holds NaN or infinite values: every logit of "
        "the model would be NaN")


def test_a_header_that_fits_reads_back_its_tensors():
    assert safetensors_header(_header(GOOD, bytes(1024))) == {"layers.0.q_proj.lora_a": ("F32", [64, 4])}


def test_the_master_adds_an_adapter_once_and_keeps_its_name_and_its_users(adapter_dir, foreign_adapter):
    adapter = _adapter(adapter_dir)

    def run(state: State, command):
        return decide(state, command, builtin_cards={TINY_MODEL_ID: CARD}, ids=iter(["x"] * 10))

    [added] = run(State(), AddAdapter(command_id="c1", adapter=adapter))
    assert isinstance(added, AdapterAdded) and added.adapter == adapter
    state = State(adapters={"pirate": adapter})
    assert run(state, AddAdapter(command_id="c2", adapter=adapter)) == [AdapterAdded(command_id="c2", adapter=adapter)]
    cases = [
        (State(), AddAdapter(command_id="c", adapter=msgspec.structs.replace(adapter, base_model="org/none")),
         "not_found", "unknown base model"),
        (State(), AddAdapter(command_id="c", adapter=msgspec.structs.replace(adapter, name="a:b")), "invalid", "name"),
        (State(), AddAdapter(command_id="c", adapter=_adapter(foreign_adapter)), "invalid", "trained for another model"),
        (state, AddAdapter(command_id="c", adapter=msgspec.structs.replace(adapter, digest="b" * 64)), "conflict",
         "exists already"),
        (State(), DeleteAdapter(command_id="c", name="pirate"), "not_found", "unknown adapter"),
        (msgspec.structs.replace(state, instances={"i": Instance(instance_id="i", model_id=adapter.model_id)}),
         DeleteAdapter(command_id="c", name="pirate"), "conflict", "delete them first"),
    ]
    for before, command, code, words in cases:
        [rejected] = run(before, command)
        assert isinstance(rejected, CommandRejected) and rejected.code == code and words in rejected.reason, rejected


# --- through a node ---

@pytest.fixture(scope="module")
def node(tmp_path_factory, model_dir, adapter_dir):
    with exo_serving(tmp_path_factory.mktemp("node"), {TINY_MODEL_ID: model_dir, ADAPTER_REPO: adapter_dir}) as exo:
        yield exo


@pytest.fixture(scope="module")
def http(node):
    with httpx.Client(base_url=node.url, timeout=300) as client:
        assert client.post("/models/add", json={"model_id": TINY_MODEL_ID}).status_code == 200
        yield client


def upload(http: httpx.Client, name: str, folder: Path, base: str = TINY_MODEL_ID) -> httpx.Response:
    config, weights = _files(folder)
    return http.post("/adapters", data={"name": name, "base_model": base},
                     files={"config": ("adapter_config.json", config), "weights": ("adapters.safetensors", weights)})


def _objects(node) -> set[str]:
    async def names() -> set[str]:
        nc = await connect([nats_url_of(node)], name="test-adapters")
        try:
            store = await nc.jetstream().object_store(ADAPTERS_BUCKET)
            return {info.name for info in await store.list(ignore_deletes=True)}
        except Exception as error:  # nats-py raises NotFoundError for an empty bucket
            if "NotFound" in type(error).__name__:
                return set()
            raise
        finally:
            await nc.close()

    return asyncio.run(names())


@pytest.mark.slow
def test_an_adapter_serves_mlx_lm_text_with_it_loaded_beside_its_base(node, http, model_dir, adapter_dir):
    added = upload(http, "pirate", adapter_dir)
    assert added.status_code == 200, added.text
    weights = (adapter_dir / "adapters.safetensors").read_bytes()
    assert added.json()["adapter"]["digest"] == hashlib.sha256(weights).hexdigest()
    assert hashlib.sha256(weights).hexdigest() in _objects(node)
    model = f"{TINY_MODEL_ID}:pirate"
    listed = {m["id"]: m for m in http.get("/v1/models").json()["data"]}
    assert listed[model]["parent"] == TINY_MODEL_ID
    place(http, TINY_MODEL_ID)
    place(http, model)
    base, adapted = Reference(model_dir), Reference(model_dir, adapter_dir)
    client = openai.OpenAI(base_url=f"{node.url}/v1", api_key="unused")
    for name, reference in ((TINY_MODEL_ID, base), (model, adapted)):
        answer = client.chat.completions.create(model=name, messages=ASK, max_tokens=40, temperature=0)
        assert answer.choices[0].message.content == reference.chat(ASK, 40), name
        assert answer.model == name
    streamed = client.chat.completions.create(model=model, messages=ASK, max_tokens=40, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == adapted.chat(ASK, 40)
    assert adapted.chat(ASK, 40) != base.chat(ASK, 40)  # the adapter is at work
    completion = http.post("/v1/completions", json={"model": model, "prompt": "Once upon", "max_tokens": 30,
                                                    "temperature": 0}).json()
    assert completion["choices"][0]["text"] == adapted.generate("Once upon", 30)
    # Every surface names it the same way: Anthropic's and Ollama's too.
    message = http.post("/v1/messages", json={"model": model, "messages": ASK, "max_tokens": 40, "temperature": 0}).json()
    assert message["content"][0]["text"] == adapted.chat(ASK, 40)
    ollama = http.post("/api/chat", json={"model": model, "messages": ASK, "stream": False,
                                          "options": {"num_predict": 40, "temperature": 0}}).json()
    assert ollama["message"]["content"] == adapted.chat(ASK, 40)


@pytest.mark.slow
def test_an_adapter_from_the_hub_is_the_same_object_as_its_upload(node, http, adapter_dir):
    added = http.post("/adapters", json={"name": "pirate-hub", "base_model": TINY_MODEL_ID, "hub_id": ADAPTER_REPO})
    assert added.status_code == 200, added.text
    entry = added.json()["adapter"]
    assert entry["digest"] == hashlib.sha256((adapter_dir / "adapters.safetensors").read_bytes()).hexdigest()
    assert entry["source"] == f"{ADAPTER_REPO}@main" and entry["model"] == f"{TINY_MODEL_ID}:pirate-hub"
    assert http.get("/adapters/pirate-hub").json()["digest"] == entry["digest"]
    assert http.delete("/adapters/pirate-hub").status_code == 200
    assert http.get("/adapters/pirate-hub").status_code == 404


@pytest.mark.slow
def test_what_does_not_fit_is_refused_with_the_reason_and_leaves_no_object(node, http, adapter_dir, foreign_adapter,
                                                                           narrow_kv_adapter, poisoned_adapter):
    before = _objects(node)
    cases = [
        (upload(http, "foreign", foreign_adapter), 400, "trained for another model"),
        (upload(http, "narrow", narrow_kv_adapter), 400,
         f"model.layers.0.self_attn.k_proj.lora_b is [4, 16], but {TINY_MODEL_ID} needs [4, 32]"),
        (upload(http, "poisoned", poisoned_adapter), 400, "model.layers.1.self_attn.v_proj.lora_b holds NaN or infinite"),
        (upload(http, "x", adapter_dir, base="org/nothing"), 404, "unknown base model"),
        (upload(http, "a:b", adapter_dir), 400, "name must be"),
        (http.post("/adapters", data={"name": "x", "base_model": TINY_MODEL_ID},
                   files={"config": ("c", b"{}"), "weights": ("w", b"junk")}), 400, "not an mlx-lm LoRA adapter"),
        (http.post("/adapters", data={"name": "x", "base_model": TINY_MODEL_ID}, files={"config": ("c", b"{}")}), 400,
         "no weights file"),
        (http.post("/adapters", json={"name": "x", "base_model": TINY_MODEL_ID, "hub_id": TINY_MODEL_ID}), 404,
         "not an mlx-lm LoRA adapter"),
        (http.post("/adapters", json={"name": "x", "base_model": TINY_MODEL_ID}), 400, "hub_id"),
        (http.post("/adapters", json={"name": "x", "base_model": TINY_MODEL_ID, "hub_id": "../../etc"}), 400,
         "hub_id must be a Hub repository id"),
        (http.post("/adapters", data={f"f{n}": "x" for n in range(9)}, files={"config": ("c", b"{}")}), 400,
         "more than 8 parts"),
        (http.post("/v1/chat/completions", json={"model": f"{TINY_MODEL_ID}:nobody", "messages": ASK}), 404,
         "does not exist"),
        (http.delete("/adapters/nobody"), 404, "unknown adapter"),
    ]
    for answer, status, words in cases:
        assert answer.status_code == status, answer.text
        assert words in answer.json()["error"]["message"], answer.text
    assert _objects(node) == before  # the foreign adapter's weights went back out


@pytest.mark.slow
def test_a_corrupt_adapter_object_fails_its_instance_with_the_reason(node, http, model_dir, tmp_path):
    broken = make_adapter(model_dir, tmp_path / "broken", seed=99)
    assert upload(http, "broken", broken).status_code == 200
    weights = (broken / "adapters.safetensors").read_bytes()
    digest = hashlib.sha256(weights).hexdigest()

    async def corrupt() -> None:  # other bytes under its name, the same size
        nc = await connect([nats_url_of(node)], name="test-adapters")
        try:
            await (await nc.jetstream().object_store(ADAPTERS_BUCKET)).put(digest, bytes(reversed(weights)))
        finally:
            await nc.close()

    asyncio.run(corrupt())
    placed = http.post("/place_instance", json={"model_id": f"{TINY_MODEL_ID}:broken", "wait": 60})
    assert placed.status_code != 200, placed.text
    message = placed.json()["error"]["message"]
    assert f"adapter {digest}" in message and "hash to" in message, message
    assert not (node.data_dir / "adapters" / "weights" / digest).exists()
    # Deleting the adapter with its failed instance placed is refused; without it, allowed.
    assert http.delete("/adapters/broken").status_code == 409
    for instance in http.get("/state").json()["instances"].values():
        if instance["model_id"].endswith(":broken"):
            assert http.delete(f"/instance/{instance['instance_id']}").status_code == 200
    assert http.delete("/adapters/broken").status_code == 200
    assert digest not in _objects(node)


# --- a worker's copies on disk ---

def _tiny_adapter(name: str, seed: int) -> tuple[Adapter, bytes]:
    weights = _header(GOOD, bytes([seed]) * 1024)
    facts = read_adapter(CONFIG, weights)
    assert not isinstance(facts, str), facts
    return Adapter(name=name, base_model=TINY_MODEL_ID, digest=hashlib.sha256(weights).hexdigest(), size=len(weights),
                   config=CONFIG.decode(), **msgspec.structs.asdict(facts)), weights


async def test_a_worker_keeps_verified_copies_within_its_bound_and_never_drops_one_in_use(nc, tmp_path):
    from exo.bus.adapters import store_adapter
    from exo.worker.adapter_files import AdapterFiles

    (first, first_bytes), (second, second_bytes) = _tiny_adapter("a", 1), _tiny_adapter("b", 2)
    for weights in (first_bytes, second_bytes):
        await store_adapter(nc, weights)
    in_use = {first.digest}
    files = AdapterFiles(nc, tmp_path, limit_bytes=len(first_bytes) + 10, in_use=lambda: in_use)
    folder = await files.folder_for(first)
    assert (folder / "adapter_config.json").read_bytes() == CONFIG
    assert (folder / "adapters.safetensors").read_bytes() == first_bytes
    # A copy changed on disk is not used: it is fetched again.
    (tmp_path / "weights" / first.digest).write_bytes(bytes(len(first_bytes)))
    assert (await files.folder_for(first) / "adapters.safetensors").read_bytes() == first_bytes
    # Over the bound, the least recently used goes, unless a runner uses it.
    await files.folder_for(second)
    assert files.weights.digests() == {first.digest}
    in_use = {second.digest}
    await files.folder_for(second)
    assert files.weights.digests() == {second.digest}
