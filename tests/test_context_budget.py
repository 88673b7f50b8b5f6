"""An instance's context, end to end: placement reserves the KV cache of its max_context beside
the weights (or refuses with the numbers), the context is in State, /v1/models and previews, and
a request that outgrows it is a 400 before any work, as a request over the model's own would be."""

from __future__ import annotations

import mlx_lm
import pytest

from exo.core.placement import human_bytes
from tests.support.e2e import Reference, one_model_node, place
from tests.support.tiny_model import TINY_MODEL_ID, Dims, make_tiny_model

pytestmark = pytest.mark.slow

SHORT = "local/short"
# 2 layers x 2 KV heads x head dim 16 x 2 (K and V) x 4 bytes (float32): 512 bytes a token.
PER_TOKEN = 2 * 2 * 16 * 2 * 4


model_dir, node = one_model_node(TINY_MODEL_ID, make_tiny_model)


@pytest.fixture(scope="module")
def short(http, model_dir) -> Reference:
    assert http.post("/models/add", json={"model_id": SHORT, "path": str(model_dir)}).status_code == 200
    placed = http.post("/place_instance", json={"model_id": SHORT, "max_context": 64, "wait": True})
    assert placed.status_code == 200, placed.text
    instance = placed.json()["instance"]
    assert instance["max_context"] == 64 and instance["shards"][0]["kv_bytes"] == 64 * PER_TOKEN
    return Reference(model_dir)


def ask(http, text: str, max_tokens: int):
    return http.post("/v1/chat/completions", json={"model": SHORT, "messages": [{"role": "user", "content": text}],
                                                   "max_tokens": max_tokens, "temperature": 0})


def test_the_context_is_shown_where_models_and_instances_are(http, short):
    card = http.get(f"/v1/models/{SHORT}").json()
    assert card["max_context"] == 64 and card["card"]["kv_dtype_bytes"] == 4  # float32, from its config.json
    listed = {m["id"]: m for m in http.get("/v1/models").json()["data"]}
    assert listed[SHORT]["max_context"] == 64 and listed["mlx-community/Qwen3-0.6B-4bit"]["max_context"] is None
    (instance,) = [i for i in http.get("/state").json()["instances"].values() if i["model_id"] == SHORT]
    assert instance["max_context"] == 64


def test_a_prompt_over_the_context_is_a_400_before_any_work(http, short):
    response = ask(http, "Tell me about the sea. " * 20, 4)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "context_length_exceeded" and "this instance's context is 64" in error["message"]
    over = ask(http, "Hi", 65)
    assert over.status_code == 400 and over.json()["error"]["param"] == "max_tokens"
    assert "at most 64 (the model's context)" in over.json()["error"]["message"]


def test_the_answer_stops_where_the_context_ends(http, short):
    messages = [{"role": "user", "content": "Tell me about the sea."}]
    prompt = short.prompt_tokens(short.chat_prompt(messages))
    reply = ask(http, "Tell me about the sea.", 64).json()
    assert reply["usage"] == {"prompt_tokens": prompt, "completion_tokens": 64 - prompt, "total_tokens": 64,
                              "prompt_tokens_details": {"cached_tokens": 0}}
    assert reply["choices"][0]["finish_reason"] == "length"
    assert reply["choices"][0]["message"]["content"] == short.chat(messages, 64 - prompt)


def test_a_context_that_cannot_fit_is_refused_with_the_reason(http, short, model_dir):
    huge = {"model_id": "local/huge-context", "path": str(model_dir), "n_layers": 2, "hidden_size": 64,
            "num_attention_heads": 4, "num_key_value_heads": 2, "kv_dtype_bytes": 4, "context_length": 10**8}
    assert http.post("/models/add", json=huge).status_code == 200
    refused = http.post("/place_instance", json={"model_id": "local/huge-context", "max_context": 10**8})
    assert refused.status_code == 409, refused.text
    assert f"needs {human_bytes(10**8 * PER_TOKEN)} of KV cache" in refused.json()["error"]["message"]
    previews = http.get("/instance/previews", params={"model_id": "local/huge-context", "max_context": 10**8}).json()
    assert all(p["instance"] is None and "KV cache" in p["error"] for p in previews["previews"] if p["node_count"] == 1)
    too_long = http.post("/place_instance", json={"model_id": SHORT, "max_context": 32769})
    assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "max_context"
    too_short = http.post("/place_instance", json={"model_id": SHORT, "max_context": 1})  # could serve nothing
    assert too_short.status_code == 400 and too_short.json()["error"]["param"] == "max_context"
    assert "between 64" in too_short.json()["error"]["message"]
    fits = http.get("/instance/previews", params={"model_id": SHORT}).json()["previews"][0]
    assert fits["max_context"] == 32768 and fits["instance"]["shards"][0]["kv_bytes"] == 32768 * PER_TOKEN


def test_the_default_model_keeps_its_whole_context(http, short):
    place(http, TINY_MODEL_ID)
    assert http.get(f"/v1/models/{TINY_MODEL_ID}").json()["max_context"] == 32768


@pytest.fixture(scope="module")
def wide_heads(tmp_path_factory) -> Reference:
    """The tiny model with a head dim of 32: a KV cache mlx can quantize (groups of 32)."""
    return Reference(make_tiny_model(tmp_path_factory.mktemp("model") / "wide",
                                     Dims(hidden=128, intermediate=256, heads=4, kv_heads=2)))


def test_a_quantized_kv_cache_gives_mlx_lms_quantized_output(http, short, wide_heads):
    path = str(wide_heads.model_dir)
    assert http.post("/models/add", json={"model_id": "local/q4", "path": path}).status_code == 200
    preview = http.get("/instance/previews", params={"model_id": "local/q4", "kv_bits": 4}).json()["previews"][0]
    full = 2 * 2 * 32 * 2 * 4  # 2 layers x 2 KV heads x 32 x K and V x float32
    assert preview["instance"]["shards"][0]["kv_bytes"] == 32768 * 2 * 2 * 32 * 2 * (0.5 + 2 * 4 / 32)  # < full / 5
    assert preview["instance"]["shards"][0]["kv_bytes"] < 32768 * full / 5
    refused = http.get("/instance/previews", params={"model_id": SHORT, "kv_bits": 4}).json()["previews"][0]
    assert "head dim, 16, is not a multiple of 32" in refused["error"]
    placed = http.post("/place_instance", json={"model_id": "local/q4", "kv_bits": 4, "wait": True})
    assert placed.status_code == 200 and placed.json()["instance"]["kv_bits"] == 4, placed.text
    messages = [{"role": "user", "content": "Tell me about the sea."}]
    prompt = wide_heads.chat_prompt(messages)
    quantized = mlx_lm.generate(wide_heads.model, wide_heads.tokenizer, prompt, max_tokens=24, kv_bits=4,
                                kv_group_size=32, quantized_kv_start=0)
    assert quantized != wide_heads.generate(prompt, 24)  # 4 bits change this text: the test can fail
    body = {"model": "local/q4", "messages": messages, "max_tokens": 24, "temperature": 0}
    first = http.post("/v1/chat/completions", json=body).json()
    assert first["choices"][0]["message"]["content"] == quantized
    again = http.post("/v1/chat/completions", json=body).json()  # from the runner's (quantized) prompt cache
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert again["choices"][0]["message"]["content"] == quantized
