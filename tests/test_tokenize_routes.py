"""Token counting (POST /tokenize and /detokenize in vLLM's and llama.cpp's shapes, Anthropic's
/v1/messages/count_tokens) against `exo` as a process with cards and no runner: token ids,
templated prompts and texts equal mlx-lm's own on the same model folders; the tokenizer files come
from the (fake) Hub without weights; bad input, keys and limits are answered as chat answers them."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import mlx_lm.utils
import pytest

from tests.support.e2e import place, start_exo
from tests.support.exo_process import ExoProcess
from tests.support.fake_hub import FakeHub
from tests.support.polling import wait_until
from tests.support.thinking_model import THINKING_MODEL_ID, make_thinking_model
from tests.support.tiny_model import TINY_MODEL_ID, make_tiny_model
from tests.support.tool_model import TOOL_MODEL_ID, WEATHER_TOOL, make_tool_model

pytestmark = pytest.mark.slow

ADMIN = "admin-key"
AS_ADMIN = {"Authorization": f"Bearer {ADMIN}"}
MAKERS = {TINY_MODEL_ID: make_tiny_model, TOOL_MODEL_ID: make_tool_model, THINKING_MODEL_ID: make_thinking_model}
TEXT = "Hello there! How are you today? The capital of France is Paris."
TOOL_TURNS = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is the weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "content": "Sunny, 21 C", "tool_call_id": "call_1"},
    {"role": "user", "content": "And tomorrow?"},
]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {model_id: make(root / model_id.replace("/", "--")) for model_id, make in MAKERS.items()}


@pytest.fixture(scope="module")
def hub(model_dirs: dict[str, Path]) -> Iterator[FakeHub]:
    with FakeHub(model_dirs) as fake:
        yield fake


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory, hub: FakeHub) -> Iterator[ExoProcess]:
    # A body limit past the text bound, so that bound is what a long prompt meets.
    exo = start_exo(tmp_path_factory.mktemp("node"), hub, {"EXO_API_KEYS": ADMIN, "EXO_MAX_BODY_BYTES": str(4 << 20)})
    yield exo
    exo.interrupt()


@pytest.fixture(scope="module")
def http(node: ExoProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=node.url, timeout=60, headers=AS_ADMIN) as client:
        for model_id in MAKERS:
            added = client.post("/models/add", json={"model_id": model_id})
            assert added.status_code == 200, added.text
        yield client


@pytest.fixture(scope="module")
def tokenizers(model_dirs: dict[str, Path]) -> dict[str, Any]:
    """mlx-lm's tokenizer of each folder, loaded as mlx_lm.load loads it."""
    return {model_id: mlx_lm.utils.load_tokenizer(path, eos_token_ids=json.loads((path / "config.json").read_text())
                                                  .get("eos_token_id")) for model_id, path in model_dirs.items()}


def templated(tokenizer: Any, messages: list[dict[str, Any]], **options: Any) -> list[int]:
    """mlx-lm's chat template, then the ids stream_generate would feed the model."""
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, **({"add_generation_prompt": True} | options))
    ids: list[int] = tokenizer.encode(prompt, add_special_tokens=not prompt.startswith(tokenizer.bos_token))
    return ids


def test_no_runner_and_no_weights_are_needed(http, hub, node):
    before = dict(hub.downloads)  # /models/add read config.json already
    tokenized = http.post("/tokenize", json={"model": TINY_MODEL_ID, "prompt": TEXT})
    assert tokenized.status_code == 200, tokenized.text
    assert http.get("/state").json()["instances"] == {}
    fetched = {key: count - before.get(key, 0) for key, count in hub.downloads.items() if count != before.get(key, 0)}
    assert fetched == {f"{TINY_MODEL_ID}/{name}": 1 for name in
                       ("config.json", "generation_config.json", "special_tokens_map.json", "tokenizer.json",
                        "tokenizer_config.json")}  # each support file once, no weights
    cached = node.data_dir / "tokenizers" / TINY_MODEL_ID.replace("/", "--")
    assert (cached / "tokenizer.json").is_file() and not (cached / "model.safetensors").exists()
    downloads, asked = dict(hub.downloads), len(hub.requests)
    assert http.post("/tokenize", json={"model": TINY_MODEL_ID, "prompt": TEXT}).json() == tokenized.json()
    assert (hub.downloads, len(hub.requests)) == (downloads, asked)  # the Hub is not even asked for its listing


def test_vllm_prompt_is_encoded_as_mlx_lm_encodes_it(http, tokenizers):
    tokenizer = tokenizers[TINY_MODEL_ID]
    answer = http.post("/tokenize", json={"model": TINY_MODEL_ID, "prompt": TEXT, "return_token_strs": True}).json()
    expected = tokenizer.encode(TEXT)
    assert answer == {"count": len(expected), "max_model_len": 32768, "tokens": expected,
                      "token_strs": tokenizer.convert_ids_to_tokens(expected)}
    assert expected[0] == tokenizer.bos_token_id  # add_special_tokens defaults to true for a prompt
    plain = http.post("/tokenize", json={"model": TINY_MODEL_ID, "prompt": TEXT, "add_special_tokens": False}).json()
    assert plain == {"count": len(expected) - 1, "max_model_len": 32768, "tokens": expected[1:], "token_strs": None}


def test_vllm_messages_go_through_the_chat_template_as_chat_renders_them(http, tokenizers):
    tokenizer = tokenizers[TOOL_MODEL_ID]
    wire_turns = [m | {"tool_calls": [c | {"function": c["function"] | {"arguments": json.dumps(c["function"]["arguments"])}}
                                      for c in m["tool_calls"]]} if "tool_calls" in m else m for m in TOOL_TURNS]
    answer = http.post("/tokenize", json={"model": TOOL_MODEL_ID, "messages": wire_turns, "tools": [WEATHER_TOOL]}).json()
    prompt = tokenizer.apply_chat_template(TOOL_TURNS, tools=[WEATHER_TOOL], add_generation_prompt=True, tokenize=False)
    assert answer["tokens"] == tokenizer.encode(prompt, add_special_tokens=False) == templated(
        tokenizer, TOOL_TURNS, tools=[WEATHER_TOOL])
    assert answer["count"] == len(answer["tokens"]) and "<tool_call>" in prompt and "<tools>" in prompt
    final = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello, I am"}]
    continued = http.post("/tokenize", json={"model": TOOL_MODEL_ID, "messages": final, "add_generation_prompt": False,
                                             "continue_final_message": True}).json()
    prompt = tokenizer.apply_chat_template(final, continue_final_message=True, tokenize=False)
    assert continued["tokens"] == tokenizer.encode(prompt, add_special_tokens=False)
    assert tokenizer.decode(continued["tokens"]).endswith("Hello, I am")


def test_the_thinking_switch_reaches_the_template(http, tokenizers):
    tokenizer, messages = tokenizers[THINKING_MODEL_ID], [{"role": "user", "content": "Hi"}]
    for switch in (True, False):
        answer = http.post("/tokenize", json={"model": THINKING_MODEL_ID, "messages": messages,
                                              "chat_template_kwargs": {"enable_thinking": switch}}).json()
        assert answer["tokens"] == templated(tokenizer, messages, enable_thinking=switch)
    counted = anthropic.Anthropic(base_url=str(http.base_url), api_key=ADMIN, max_retries=0).messages.count_tokens(
        model=THINKING_MODEL_ID, messages=messages, thinking={"type": "disabled"})
    assert counted.input_tokens == len(templated(tokenizer, messages, enable_thinking=False))


def test_vllm_detokenize_gives_mlx_lm_decode(http, tokenizers):
    tokenizer = tokenizers[TOOL_MODEL_ID]
    ids = tokenizer.encode("<tool_call>" + TEXT)
    answer = http.post("/detokenize", json={"model": TOOL_MODEL_ID, "tokens": ids})
    assert answer.json() == {"prompt": tokenizer.decode(ids)}


def test_llama_cpp_shapes_with_a_model_named(http, tokenizers):
    tokenizer = tokenizers[TINY_MODEL_ID]
    plain = http.post("/tokenize", json={"model": TINY_MODEL_ID, "content": TEXT}).json()
    assert plain == {"tokens": tokenizer.encode(TEXT, add_special_tokens=False)}  # add_special defaults to false
    pieces = http.post("/tokenize", json={"model": TINY_MODEL_ID, "content": TEXT, "add_special": True,
                                          "with_pieces": True}).json()
    ids = tokenizer.encode(TEXT)
    assert pieces == {"tokens": [{"id": i, "piece": tokenizer.decode([i])} for i in ids]}


def test_anthropic_count_tokens_counts_the_prompt_messages_would_send(http, tokenizers):
    claude = anthropic.Anthropic(base_url=str(http.base_url), api_key=ADMIN, max_retries=0)
    counted = claude.messages.count_tokens(
        model=TOOL_MODEL_ID, system="You are terse.",
        tools=[{"name": "get_weather", "description": "The weather in a city",
                "input_schema": WEATHER_TOOL["function"]["parameters"]}],  # type: ignore[index]
        messages=[{"role": "user", "content": "What is the weather in Paris?"},
                  {"role": "assistant", "content": [{"type": "tool_use", "id": "call_1", "name": "get_weather",
                                                     "input": {"city": "Paris"}}]},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "call_1", "content": "Sunny, 21 C"},
                                               {"type": "text", "text": "And tomorrow?"}]}])
    # The same conversation as chat templates know it (OpenAI's shape): what mlx-lm counts.
    assert counted.input_tokens == len(templated(tokenizers[TOOL_MODEL_ID], TOOL_TURNS, tools=[WEATHER_TOOL]))


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/tokenize", {"model": TINY_MODEL_ID}, "prompt"),
    ("/tokenize", {"model": TINY_MODEL_ID, "prompt": "a", "content": "b"}, "content"),
    ("/tokenize", {"model": TINY_MODEL_ID, "prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "messages"),
    ("/tokenize", {"model": TINY_MODEL_ID, "prompt": "x" * 1_000_001}, "prompt"),
    ("/tokenize", {"model": TINY_MODEL_ID, "content": "x" * 1_000_001}, "content"),
    ("/tokenize", {"model": TINY_MODEL_ID, "messages": [{"role": "user", "content": "x"}],
                   "continue_final_message": True}, "continue_final_message"),
    ("/tokenize", {"model": TINY_MODEL_ID, "messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ("/tokenize", {"model": TINY_MODEL_ID, "messages": [{"role": "user", "content": "x"}],
                   "chat_template_kwargs": {"foo": 1}}, "chat_template_kwargs.foo"),
    ("/tokenize", {"model": TINY_MODEL_ID, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]}, "messages"),
    ("/tokenize", {"content": "x"}, "model"),  # llama.cpp's shape, and no model placed
    ("/detokenize", {"model": TINY_MODEL_ID, "tokens": [5, 384]}, "tokens[1]"),
    ("/detokenize", {"model": TINY_MODEL_ID, "tokens": [-1]}, "tokens[0]"),
    ("/detokenize", {"model": TINY_MODEL_ID}, "tokens"),
    ("/detokenize", {"tokens": [1]}, "model"),
])
def test_bad_input_is_a_400_naming_the_field(http, path, body, param):
    answer = http.post(path, json=body)
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == param and answer.json()["error"]["type"] == "invalid_request_error"


def test_count_tokens_errors_come_in_anthropics_shape(http):
    claude = anthropic.Anthropic(base_url=str(http.base_url), api_key=ADMIN, max_retries=0)
    with pytest.raises(anthropic.NotFoundError) as missing:
        claude.messages.count_tokens(model="nobody/nothing", messages=[{"role": "user", "content": "x"}])
    assert missing.value.body == {"type": "error", "error": {"type": "not_found_error",
                                                             "message": "model: 'nobody/nothing' does not exist"}}
    with pytest.raises(anthropic.BadRequestError) as bad:
        claude.messages.count_tokens(model=TOOL_MODEL_ID, messages=[{"role": "user", "content": "x"}],
                                     tools=[{"name": "no spaces allowed", "input_schema": {"type": "object"}}])
    assert bad.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
    assert "tool names" in bad.value.body["error"]["message"]  # type: ignore[index]


def test_an_unknown_model_is_a_404_and_a_tokenizer_that_cannot_be_had_a_424(http):
    assert http.post("/tokenize", json={"model": "nobody/nothing", "prompt": "x"}).json()["error"]["code"] == \
        "model_not_found"
    card = {"model_id": "exo-test/not-on-the-hub", "n_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
            "num_key_value_heads": 4, "storage_bytes": 1000, "context_length": 128}
    assert http.post("/models/add", json=card).status_code == 200
    answer = http.post("/tokenize", json={"model": "exo-test/not-on-the-hub", "prompt": "x"})
    assert answer.status_code == 424, answer.text
    assert answer.json()["error"]["code"] == "tokenizer_unavailable" and answer.json()["error"]["param"] == "model"
    assert "exo-test/not-on-the-hub" in answer.json()["error"]["message"]
    assert "repository not found on the Hub" in answer.json()["error"]["message"]


def test_a_key_counts_only_for_the_models_chat_would_let_it_use(http, node):
    made = http.post("/keys", json={"name": "tools-only", "models": [TOOL_MODEL_ID]})
    assert made.status_code == 200, made.text
    key = made.json()["secret"]
    headers = {"Authorization": f"Bearer {key}"}
    chat = http.post("/v1/chat/completions", headers=headers,
                     json={"model": TINY_MODEL_ID, "messages": [{"role": "user", "content": "x"}]})
    refused = http.post("/tokenize", headers=headers, json={"model": TINY_MODEL_ID, "prompt": "x"})
    assert refused.status_code == chat.status_code == 403
    assert refused.json()["error"] == chat.json()["error"]
    assert http.post("/detokenize", headers=headers, json={"model": TINY_MODEL_ID, "tokens": [5]}).status_code == 403
    allowed = http.post("/tokenize", headers=headers, json={"model": TOOL_MODEL_ID, "prompt": "x"})
    assert allowed.status_code == 200, allowed.text
    claude = anthropic.Anthropic(base_url=node.url, api_key=key, max_retries=0)  # x-api-key, as Claude Code sends it
    assert claude.messages.count_tokens(model=TOOL_MODEL_ID, messages=[{"role": "user", "content": "x"}]).input_tokens > 0
    with pytest.raises(anthropic.PermissionDeniedError):
        claude.messages.count_tokens(model=TINY_MODEL_ID, messages=[{"role": "user", "content": "x"}])
    assert http.post("/tokenize", headers={"Authorization": "Bearer wrong"}, json={"prompt": "x"}).status_code == 401


def test_requests_are_counted_in_metrics(http):
    http.post("/detokenize", json={"model": TINY_MODEL_ID, "tokens": [5]})
    metrics = http.get("/metrics").text
    assert 'exo_http_requests_total{method="POST",route="/detokenize",status="200"}' in metrics
    assert 'exo_http_requests_total{method="POST",route="/tokenize",status="400"}' in metrics


def test_llama_cpp_shapes_take_the_only_model_placed_and_counts_equal_usage(http, tokenizers):
    """It places the module's instances (one, then two): this test and the next run last."""
    place(http, TINY_MODEL_ID)
    tokenizer = tokenizers[TINY_MODEL_ID]
    assert http.post("/tokenize", json={"content": TEXT}).json() == {"tokens": tokenizer.encode(TEXT, add_special_tokens=False)}
    ids = tokenizer.encode(TEXT)
    assert http.post("/detokenize", json={"tokens": ids}).json() == {"content": tokenizer.decode(ids)}
    claude = anthropic.Anthropic(base_url=str(http.base_url), api_key=ADMIN, max_retries=0)
    conversation: dict[str, Any] = {"model": TINY_MODEL_ID, "system": "You are terse.",
                                    "messages": [{"role": "user", "content": "Tell me about the sea."}]}
    counted = claude.messages.count_tokens(**conversation)
    usage = claude.messages.create(max_tokens=1, **conversation).usage
    assert counted.input_tokens == usage.input_tokens + usage.cache_read_input_tokens
    place(http, TOOL_MODEL_ID)
    refused = http.post("/tokenize", json={"content": TEXT})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "model"
    assert f"2 are placed ({TINY_MODEL_ID}, {TOOL_MODEL_ID})" in refused.json()["error"]["message"]


def test_a_key_past_its_limit_is_refused_as_chat_refuses_it(http):
    made = http.post("/keys", json={"name": "one-a-minute", "limits": {"requests_per_minute": 1}})
    assert made.status_code == 200, made.text
    headers = {"Authorization": f"Bearer {made.json()['secret']}"}
    messages = [{"role": "user", "content": "x"}]
    assert http.post("/tokenize", headers=headers, json={"model": TINY_MODEL_ID, "prompt": "x"}).status_code == 200
    first = http.post("/v1/chat/completions", headers=headers, json={"model": TINY_MODEL_ID, "messages": messages,
                                                                      "max_tokens": 1})
    assert first.status_code == 200, first.text
    chat = http.post("/v1/chat/completions", headers=headers, json={"model": TINY_MODEL_ID, "messages": messages})
    refused = http.post("/tokenize", headers=headers, json={"model": TINY_MODEL_ID, "prompt": "x"})
    assert refused.status_code == chat.status_code == 429
    assert refused.json()["error"]["code"] == chat.json()["error"]["code"] == "rate_limited"
    assert 1 <= int(refused.headers["Retry-After"]) <= 60


def test_counting_has_a_request_window_of_its_own_and_adds_nothing_to_usage(http, node):
    """As Anthropic limits count_tokens: by requests per minute, apart from the key's generations."""
    made = http.post("/keys", json={"name": "two-a-minute", "limits": {"requests_per_minute": 2}})
    assert made.status_code == 200, made.text
    secret, key_id = made.json()["secret"], made.json()["key"]["key_id"]
    headers, messages = {"Authorization": f"Bearer {secret}"}, [{"role": "user", "content": "x"}]
    claude = anthropic.Anthropic(base_url=node.url, api_key=secret, max_retries=0)
    assert http.post("/tokenize", headers=headers, json={"model": TINY_MODEL_ID, "prompt": "x"}).status_code == 200
    assert claude.messages.count_tokens(model=TINY_MODEL_ID, messages=messages).input_tokens > 0
    with pytest.raises(anthropic.RateLimitError) as refused:  # the third count in a minute
        claude.messages.count_tokens(model=TINY_MODEL_ID, messages=messages)
    assert refused.value.body["error"]["type"] == "rate_limit_error"
    assert "2 token counting requests in the last minute" in refused.value.message
    assert 1 <= int(refused.value.response.headers["Retry-After"]) <= 60
    again = http.post("/detokenize", headers=headers, json={"model": TINY_MODEL_ID, "tokens": [5]})
    assert again.status_code == 429 and again.json()["error"]["code"] == "rate_limited"
    chats = [http.post("/v1/chat/completions", headers=headers,
                       json={"model": TINY_MODEL_ID, "messages": messages, "max_tokens": 1}) for _ in range(2)]
    assert [c.status_code for c in chats] == [200, 200]  # the counts used none of its generations' window
    prompt = chats[0].json()["usage"]["prompt_tokens"]

    def counted() -> list[tuple[int, int]]:  # folded once both chats' tasks finish: the counts are in none of it
        return [(row["requests"], row["prompt_tokens"]) for row in http.get("/usage").json()["data"] if row["key_id"] == key_id]
    assert wait_until(lambda: counted() == [(2, 2 * prompt)], timeout=10, what="the two chats in usage, nothing else")
    metrics = http.get("/metrics").text
    assert 'exo_http_requests_total{method="POST",route="/v1/messages/count_tokens",status="429"} 1' in metrics
