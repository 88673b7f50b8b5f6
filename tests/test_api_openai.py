"""The OpenAI surface beyond plain chat, with the official `openai` client against `exo` as a
process: penalties, logprobs, tool calls (parsed by mlx-lm's parser), completions, responses,
models by id. Every greedy text is compared with mlx-lm's own output, exactly."""

from __future__ import annotations

import json
import re
from pathlib import Path

import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mlx_lm.sample_utils import make_logits_processors

from tests.support.e2e import Reference, place
from tests.support.fake_hub import FakeHub
from tests.support.tiny_model import TINY_MODEL_ID, make_tiny_model
from tests.support.tool_model import CALL_ARGUMENTS, CALL_NAME, TOOL_MODEL_ID, WEATHER_TOOL, make_tool_model

pytestmark = pytest.mark.slow

MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Tell me about the sea."}]
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {TINY_MODEL_ID: make_tiny_model(root / "tiny"), TOOL_MODEL_ID: make_tool_model(root / "tools")}


@pytest.fixture(scope="module")
def hub(models):
    with FakeHub(models) as fake:
        yield fake


@pytest.fixture(scope="module")
def tiny(http, models) -> Reference:
    place(http, TINY_MODEL_ID)
    return Reference(models[TINY_MODEL_ID])


@pytest.fixture(scope="module")
def tools_ref(http, models) -> Reference:
    place(http, TOOL_MODEL_ID)
    return Reference(models[TOOL_MODEL_ID])


def test_presence_and_frequency_penalties_equal_mlx_lm_with_the_same_processors(client, tiny):
    penalised = tiny.chat(MESSAGES, 24, logits_processors=make_logits_processors(presence_penalty=1.5, frequency_penalty=0.5))
    assert penalised != tiny.chat(MESSAGES, 24)  # the penalties change this text: the test can fail
    reply = client.chat.completions.create(model=TINY_MODEL_ID, messages=MESSAGES, temperature=0, max_tokens=24,
                                           presence_penalty=1.5, frequency_penalty=0.5)
    assert reply.choices[0].message.content == penalised


def test_logprobs_are_mlx_lms_for_each_generated_token(client, tiny):
    steps = tiny.steps(tiny.chat_prompt(MESSAGES), 12)
    reply = client.chat.completions.create(model=TINY_MODEL_ID, messages=MESSAGES, temperature=0, max_tokens=12,
                                           logprobs=True, top_logprobs=3)
    content = reply.choices[0].logprobs.content
    assert [c.token for c in content] == [tiny.tokenizer.decode([s.token]) for s in steps]
    for entry, step in zip(content, steps):
        assert entry.logprob == pytest.approx(step.logprobs[step.token].item(), abs=1e-4)
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].token == entry.token  # greedy: the chosen token is the most likely
        assert [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs), reverse=True)
        assert entry.bytes == list(entry.token.encode())
    assert "".join(c.token for c in content) == reply.choices[0].message.content


def test_streamed_logprobs_match_the_whole_answer(client, tiny):
    whole = client.chat.completions.create(model=TINY_MODEL_ID, messages=MESSAGES, temperature=0, max_tokens=12,
                                           logprobs=True)
    stream = client.chat.completions.create(model=TINY_MODEL_ID, messages=MESSAGES, temperature=0, max_tokens=12,
                                            logprobs=True, stream=True)
    streamed = [c for chunk in stream if chunk.choices and chunk.choices[0].logprobs for c in chunk.choices[0].logprobs.content]
    assert [(c.token, c.logprob) for c in streamed] == [(c.token, c.logprob) for c in whole.choices[0].logprobs.content]


def test_a_tool_call_is_parsed_from_the_model_output_and_its_result_goes_back_in(client, tools_ref):
    raw = tools_ref.chat(ASK_WEATHER, 32, tools=[WEATHER_TOOL])
    assert raw.startswith("<tool_call>")  # what the model really wrote; the cluster must parse it
    reply = client.chat.completions.create(model=TOOL_MODEL_ID, messages=ASK_WEATHER, tools=[WEATHER_TOOL],
                                           temperature=0, max_tokens=32)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == CALL_NAME and call.id
    assert json.loads(call.function.arguments) == CALL_ARGUMENTS

    sent_call = {"id": call.id, "type": "function", "function": {"name": CALL_NAME, "arguments": call.function.arguments}}
    follow_up = [*ASK_WEATHER, {"role": "assistant", "content": None, "tool_calls": [sent_call]},
                 {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    answer = client.chat.completions.create(model=TOOL_MODEL_ID, messages=follow_up, tools=[WEATHER_TOOL],
                                            temperature=0, max_tokens=24)
    # The template saw the call and its result exactly as mlx-lm renders them.
    rendered = [*ASK_WEATHER, {"role": "assistant", "content": "", "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": CALL_NAME, "arguments": CALL_ARGUMENTS}}]},
        {"role": "tool", "content": "sunny, 21 C", "tool_call_id": call.id}]
    prompt = tools_ref.chat_prompt(rendered, [WEATHER_TOOL])
    assert "<tool_response>sunny, 21 C</tool_response>" in prompt
    assert answer.usage.prompt_tokens == tools_ref.prompt_tokens(prompt)
    assert answer.choices[0].message.content == tools_ref.generate(prompt, 24)
    assert answer.choices[0].finish_reason == "length" and not answer.choices[0].message.tool_calls


def test_a_streamed_tool_call_arrives_as_a_delta(client, tools_ref):
    stream = client.chat.completions.create(model=TOOL_MODEL_ID, messages=ASK_WEATHER, tools=[WEATHER_TOOL],
                                            temperature=0, max_tokens=32, stream=True)
    chunks = [c for c in stream if c.choices]
    deltas = [t for c in chunks for t in (c.choices[0].delta.tool_calls or [])]
    assert len(deltas) == 1 and deltas[0].index == 0 and deltas[0].function.name == CALL_NAME
    assert json.loads(deltas[0].function.arguments) == CALL_ARGUMENTS
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ""
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_tool_choice_none_hides_the_tools_from_the_model(client, tools_ref):
    reply = client.chat.completions.create(model=TOOL_MODEL_ID, messages=ASK_WEATHER, tools=[WEATHER_TOOL],
                                           tool_choice="none", temperature=0, max_tokens=16)
    assert reply.choices[0].message.content == tools_ref.chat(ASK_WEATHER, 16)
    assert not reply.choices[0].message.tool_calls


def test_without_tools_the_tool_models_text_is_plain_text(client, tools_ref):
    reply = client.chat.completions.create(model=TOOL_MODEL_ID, messages=ASK_WEATHER, temperature=0, max_tokens=16)
    assert reply.choices[0].message.content == tools_ref.chat(ASK_WEATHER, 16)


def test_completions_use_the_prompt_as_is(client, tiny):
    prompt = "Once upon a time, in a small village"
    expected = tiny.generate(prompt, 20)
    reply = client.completions.create(model=TINY_MODEL_ID, prompt=prompt, max_tokens=20, temperature=0)
    assert reply.choices[0].text == expected and reply.choices[0].finish_reason == "length"
    assert reply.usage.prompt_tokens == tiny.prompt_tokens(prompt) and reply.usage.completion_tokens == 20
    assert reply.object == "text_completion" and reply.id.startswith("cmpl-")
    stream = client.completions.create(model=TINY_MODEL_ID, prompt=prompt, max_tokens=20, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in stream) == expected


def test_completions_default_to_sixteen_tokens_and_give_logprobs_in_their_own_shape(client, tiny):
    reply = client.completions.create(model=TINY_MODEL_ID, prompt="Hello there", temperature=0, logprobs=2)
    logprobs = reply.choices[0].logprobs
    assert reply.usage.completion_tokens == 16
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 16
    assert "".join(logprobs.tokens) == reply.choices[0].text
    assert all(len(top) <= 2 and max(top.values()) == lp for top, lp in zip(logprobs.top_logprobs, logprobs.token_logprobs))
    assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:n]) for n in range(16)]


def test_responses_text_in_text_out(client, tiny):
    expected = tiny.chat(MESSAGES, 24)
    response = client.responses.create(model=TINY_MODEL_ID, instructions="You are terse.",
                                       input="Tell me about the sea.", max_output_tokens=24, temperature=0)
    assert response.output_text == expected
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 24

    events = list(client.responses.create(model=TINY_MODEL_ID, instructions="You are terse.", stream=True,
                                          input=[{"role": "user", "content": "Tell me about the sea."}],
                                          max_output_tokens=24, temperature=0))
    assert events[0].type == "response.created" and events[-1].type == "response.incomplete"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == expected
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[-1].response.output[0].content[0].text == expected


def test_a_model_by_id(client, http, tiny):
    assert client.models.retrieve(TINY_MODEL_ID).id == TINY_MODEL_ID
    assert http.get(f"/v1/models/{TINY_MODEL_ID}").json()["card"]["n_layers"] == 2
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nobody/nothing")


def test_model_card_sampling_defaults_apply_when_the_request_leaves_them_out(http, client, models, tiny):
    card = {"model_id": "local/hot", "path": str(models[TINY_MODEL_ID]), "sampling": {"temperature": 1.5, "top_p": 0.95}}
    assert http.post("/models/add", json=card).status_code == 200
    place(http, "local/hot")
    ask = dict(messages=MESSAGES, max_tokens=16, seed=3)
    hot = client.chat.completions.create(model="local/hot", **ask).choices[0].message.content
    explicit = client.chat.completions.create(model=TINY_MODEL_ID, temperature=1.5, top_p=0.95, **ask)
    assert hot == explicit.choices[0].message.content != tiny.chat(MESSAGES, 16)
    greedy = client.chat.completions.create(model="local/hot", temperature=0, **ask)
    assert greedy.choices[0].message.content == tiny.chat(MESSAGES, 16)


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/chat/completions", {"messages": MESSAGES, "presence_penalty": 3}, "presence_penalty"),
    ("/v1/chat/completions", {"messages": MESSAGES, "frequency_penalty": -2.5}, "frequency_penalty"),
    ("/v1/chat/completions", {"messages": MESSAGES, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": MESSAGES, "top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": MESSAGES, "tools": [{"type": "retrieval"}]}, "tools[0].function"),
    ("/v1/chat/completions", {"messages": MESSAGES, "tools": [{"type": "code", "function": {"name": "f"}}]}, "tools[0].type"),
    ("/v1/chat/completions", {"messages": MESSAGES, "tools": [{"type": "function", "function": {"name": "no spaces"}}]},
     "tools[0].function.name"),
    ("/v1/chat/completions", {"messages": MESSAGES, "tool_choice": "auto"}, "tool_choice"),
    ("/v1/chat/completions", {"messages": MESSAGES, "tools": [WEATHER_TOOL],
                              "tool_choice": {"type": "function", "function": {"name": "other"}}}, "tool_choice"),
    ("/v1/chat/completions", {"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x", "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}, "messages[0].tool_calls"),
    ("/v1/completions", {"prompt": ""}, "prompt"),
    ("/v1/completions", {"prompt": ["a", "b"]}, "prompt"),
    ("/v1/completions", {"prompt": [1, 2, 3]}, "prompt[0]"),
    ("/v1/completions", {"prompt": "x", "n": 17}, "n"),
    ("/v1/completions", {"prompt": "x", "echo": True}, "echo"),
    ("/v1/completions", {"prompt": "x", "logprobs": 6}, "logprobs"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ("/v1/responses", {"input": []}, "input"),
    ("/v1/responses", {"input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
    ("/v1/responses", {"input": [{"role": "wizard", "content": "x"}]}, "input[0]"),
    ("/v1/responses", {"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    # Bounds (exo/api/validate.py check_limits): what a request may store in the log and in State.
    ("/v1/chat/completions", {"messages": MESSAGES, "seed": -1}, "seed"),
    ("/v1/chat/completions", {"messages": MESSAGES, "seed": 2**64}, "seed"),
    ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 10**40}, "max_tokens"),
    ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 32769}, "max_tokens"),  # the card's context: 32768
    ("/v1/chat/completions", {"messages": MESSAGES, "stop": ["x"] * 17}, "stop"),
    ("/v1/chat/completions", {"messages": MESSAGES, "stop": "x" * 1001}, "stop"),
    ("/v1/chat/completions", {"messages": MESSAGES, "tools": [{"type": "function", "function": {
        "name": "f", "description": "x" * 300_000}}]}, "tools"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 40_000}, "max_tokens"),
    ("/v1/responses", {"input": "x", "max_output_tokens": 40_000}, "max_tokens"),
])
def test_bad_requests_get_400_naming_the_parameter(http, tiny, path, body, param):
    response = http.post(path, json={"model": TINY_MODEL_ID, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    assert http.get("/health").status_code == 200


def test_deep_nesting_and_huge_since_are_400_not_500(http, tiny):
    nested = "[" * 10_000 + "]" * 10_000  # where the body may hold any JSON: a tool's parameters
    tools = f'[{{"type": "function", "function": {{"name": "f", "parameters": {{"x": {nested}}}}}}}]'
    response = http.post("/v1/chat/completions", content=f'{{"model": "{TINY_MODEL_ID}", "messages": [], "tools": {tools}}}')
    assert response.status_code == 400 and "nested too deeply" in response.json()["error"]["message"], response.text
    response = http.get("/events", params={"since": str(10**30)})
    assert response.status_code == 400 and response.json()["error"]["param"] == "since", response.text


def test_a_prompt_longer_than_the_context_is_400_and_the_instance_serves_on(http, tiny):
    words = " ".join(["hello"] * 11_000)  # 3 tokens each: past the tiny model's 32768
    body = {"model": TINY_MODEL_ID, "messages": [{"role": "user", "content": words}], "max_tokens": 4}
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["type"], error["code"], error["param"]) == ("invalid_request_error", "context_length_exceeded", "messages")
    assert re.fullmatch(r"the prompt is 330\d\d tokens; this instance's context is 32768", error["message"]), error
    streamed = http.post("/v1/chat/completions", json={**body, "stream": True})
    errors = [json.loads(line.removeprefix("data: ")) for line in streamed.text.splitlines()
              if line.startswith("data: {") and '"error"' in line]
    assert [e["error"]["code"] for e in errors] == ["context_length_exceeded"], streamed.text
    assert http.post("/v1/chat/completions", json={**body, "messages": MESSAGES}).status_code == 200


@pytest.mark.parametrize(("card", "param", "message"), [
    ({"model_id": "a/b\n"}, "model_id", "model_id must look like"),
    ({"model_id": "local/rel", "path": "relative/dir", "n_layers": 2}, "path", "path must be absolute"),
    ({"model_id": "local/neg", "n_layers": -2, "storage_bytes": 10}, "n_layers", "n_layers must not be negative"),
    ({"model_id": "local/neg2", "n_layers": 2, "storage_bytes": -10}, "storage_bytes", "storage_bytes must not be negative"),
    ({"model_id": "local/huge", "n_layers": 10**30}, "n_layers", "n_layers 1000000000000000000000000000000 is over 4096"),
    ({"model_id": "local/cold", "n_layers": 2, "sampling": {"temperature": -5}}, "sampling",
     "sampling.temperature must be between 0 and 2, not -5"),
    ({"model_id": "local/hd", "n_layers": 2, "head_dim": -1}, "head_dim", "head_dim must not be negative"),
    ({"model_id": "local/kv", "n_layers": 2, "kv_dtype_bytes": 3}, "kv_dtype_bytes", "kv_dtype_bytes must be 0"),
])
def test_cards_that_cannot_be_stored_are_400(http, tiny, card, param, message):
    response = http.post("/models/add", json=card)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param and message in response.json()["error"]["message"]
    assert card["model_id"] not in [m["id"] for m in http.get("/v1/models").json()["data"]]


def test_images_for_a_model_with_no_instance_are_refused_before_anything_is_stored(http, node, models):
    import asyncio
    import base64
    import os

    from nats.js.errors import ObjectNotFoundError

    from exo.bus.connection import connect
    from exo.bus.images import image_digest
    from exo.bus.subjects import IMAGES_BUCKET
    from tests.support.e2e import nats_url_of

    card = {"model_id": "local/vision-idle", "path": str(models[TINY_MODEL_ID]), "supports_images": True,
            "on_demand": False}  # never placed, not even by these requests
    assert http.post("/models/add", json=card).status_code == 200
    images = [os.urandom(200_000) for _ in range(3)]
    for image in images:
        part = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(image).decode()}}
        refused = http.post("/v1/chat/completions", json={"model": "local/vision-idle",
                                                          "messages": [{"role": "user", "content": [part]}]})
        assert refused.status_code == 503 and "no instance" in refused.json()["error"]["message"], refused.text
    many = [{"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(bytes([i])).decode()}}
            for i in range(17)]
    refused = http.post("/v1/chat/completions", json={"model": "local/vision-idle",
                                                      "messages": [{"role": "user", "content": many}]})
    assert refused.status_code == 400 and "at most 16 images" in refused.text

    async def stored() -> list[bool]:
        nc = await connect([nats_url_of(node)], name="image-check")
        try:
            store = await nc.jetstream().object_store(IMAGES_BUCKET)
            found = []
            for image in images:
                try:
                    await store.get_info(image_digest(image))
                    found.append(True)
                except ObjectNotFoundError:
                    found.append(False)
            return found
        finally:
            await nc.close()

    assert asyncio.run(stored()) == [False, False, False]


def test_unknown_models_are_404_on_every_openai_route(http, tiny):
    for path, body in [("/v1/completions", {"prompt": "x"}), ("/v1/responses", {"input": "x"}),
                       ("/v1/chat/completions", {"messages": MESSAGES})]:
        response = http.post(path, json={"model": "nobody/nothing", **body})
        assert response.status_code == 404 and response.json()["error"]["code"] == "model_not_found"


# -- fuzz: whatever a client sends, the answer is never a 5xx and never hangs ---------------------

_json = st.recursive(
    st.none() | st.booleans() | st.integers(-(10**12), 10**12) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8,
)
_text = st.text(max_size=16)
_few = st.integers(1, 6)  # tokens: the fuzz is about the API, not the model
_message = st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]), "content": _text})
_sampling = {
    "temperature": st.floats(0, 2), "top_p": st.floats(0, 1), "seed": st.integers(0, 9),
    "stream": st.booleans(), "stop": _text | st.lists(_text, max_size=2), "presence_penalty": st.floats(-2, 2),
}
# A valid request for each route, then (half the time) one field replaced by any JSON at all.
_bodies = {
    "/v1/chat/completions": st.fixed_dictionaries(
        {"model": st.just(TINY_MODEL_ID), "messages": st.lists(_message, min_size=1, max_size=3), "max_tokens": _few},
        optional={**_sampling, "logprobs": st.booleans(), "frequency_penalty": st.floats(-2, 2),
                  "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
                  "tools": st.just([WEATHER_TOOL]), "n": st.just(1)}),
    "/v1/completions": st.fixed_dictionaries(
        {"model": st.just(TINY_MODEL_ID), "prompt": st.text(min_size=1, max_size=24), "max_tokens": _few},
        optional={**_sampling, "logprobs": st.integers(0, 5), "echo": st.just(False)}),
    "/v1/responses": st.fixed_dictionaries(
        {"model": st.just(TINY_MODEL_ID), "input": st.text(min_size=1, max_size=24) | st.lists(_message, min_size=1, max_size=2),
         "max_output_tokens": _few},
        optional={"instructions": _text, "stream": st.booleans(),
                  "temperature": st.floats(0, 2)}),
}
_FIELDS = ["model", "messages", "prompt", "input", "max_tokens", "temperature", "top_p", "stream", "stop", "n", "seed",
           "logprobs", "top_logprobs", "presence_penalty", "tools", "tool_choice", "stream_options", "max_output_tokens",
           "echo", "suffix", "instructions", "max_completion_tokens"]


@settings(max_examples=60, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_fuzzed_openai_requests_never_get_a_5xx_or_hang(http, tiny, data):
    path = data.draw(st.sampled_from(sorted(_bodies)))
    body = data.draw(_bodies[path])
    if data.draw(st.booleans()):
        field = data.draw(st.sampled_from(_FIELDS))
        # Any JSON but a big token limit: a valid request for many tokens is slow, not wrong.
        body[field] = data.draw(_json.filter(lambda v: "max" not in field or not isinstance(v, int) or v <= 6))
    with http.stream("POST", path, json=body, timeout=60) as response:
        raw = response.read()
    assert response.status_code < 500, (path, body, raw[:500])
    if response.status_code >= 400:
        assert json.loads(raw)["error"]["message"], (path, body)
