"""Tool calls on every surface, with the official clients as they ship against `exo` as a process
and the tiny tool-calling model: Anthropic Messages (`tool_use` / `tool_result` blocks,
`input_json_delta`), OpenAI Responses (`function_call` / `function_call_output` items and their
events) and Ollama (`tools`, `tool_calls`). Each surface runs a two-step loop (call, then result,
then the final answer) whose call equals what the model wrote and whose final text equals mlx-lm's
on the prompt the chat template renders from the same conversation."""

from __future__ import annotations

import copy
import json

import httpx
import jsonschema
import pytest

from tests.support.e2e import Reference, one_model_node, place
from tests.support.llguidance_reference import Constrained, tool_call_grammar
from tests.support.tool_model import CALL_ARGUMENTS, CALL_NAME, TOOL_MODEL_ID, WEATHER_TOOL, make_tool_model

pytestmark = pytest.mark.slow

ASK = "What is the weather in Paris?"
RESULT = "sunny, 21 C"
FUNCTION = WEATHER_TOOL["function"]
CLAUDE_TOOL = {"name": FUNCTION["name"], "description": FUNCTION["description"], "input_schema": FUNCTION["parameters"]}
RESPONSES_TOOL = {"type": "function", **FUNCTION}
# The ollama client sends a tool's parameters in its own field order (required before properties),
# and chat templates render them in the order they come: the reference must see that order too.
OLLAMA_TOOL = {"type": "function", "function": {**FUNCTION, "parameters": {
    "type": "object", "required": ["city"], "properties": {"city": {"type": "string"}}}}}


model_dir, node = one_model_node(TOOL_MODEL_ID, make_tool_model)


@pytest.fixture(scope="module")
def ref(http, model_dir) -> Reference:
    place(http, TOOL_MODEL_ID)
    reference = Reference(model_dir)
    assert reference.chat([{"role": "user", "content": ASK}], 32, tools=[WEATHER_TOOL]).startswith("<tool_call>")
    return reference




def after_the_call(ref: Reference, call_id: str, tool: dict = WEATHER_TOOL) -> str:
    """The prompt mlx-lm renders once the call and its result are in the conversation."""
    call = {"id": call_id, "type": "function", "function": {"name": CALL_NAME, "arguments": CALL_ARGUMENTS}}
    messages = [{"role": "user", "content": ASK}, {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "content": RESULT, "tool_call_id": call_id}]
    prompt = ref.chat_prompt(messages, [tool])
    assert f"<tool_response>{RESULT}</tool_response>" in prompt
    return prompt


# -- Anthropic ---------------------------------------------------------------------------------

def test_anthropic_tool_loop(claude, ref):
    first = claude.messages.create(model=TOOL_MODEL_ID, max_tokens=32, tools=[CLAUDE_TOOL],
                                   messages=[{"role": "user", "content": ASK}])
    assert first.stop_reason == "tool_use"
    (block,) = first.content
    assert block.type == "tool_use" and block.name == CALL_NAME and block.input == CALL_ARGUMENTS and block.id
    second = claude.messages.create(model=TOOL_MODEL_ID, max_tokens=24, tools=[CLAUDE_TOOL], messages=[
        {"role": "user", "content": ASK},
        {"role": "assistant", "content": [block.model_dump(exclude_none=True)]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": block.id, "content": RESULT}]}])
    prompt = after_the_call(ref, block.id)
    assert [b.type for b in second.content] == ["text"]
    assert second.content[0].text == ref.generate(prompt, 24) and second.stop_reason == "max_tokens"
    assert second.usage.input_tokens + second.usage.cache_read_input_tokens == ref.prompt_tokens(prompt)


def test_anthropic_streamed_tool_use_block(claude, ref):
    with claude.messages.stream(model=TOOL_MODEL_ID, max_tokens=32, tools=[CLAUDE_TOOL],
                                messages=[{"role": "user", "content": ASK}]) as stream:
        events = list(stream)
        final = stream.get_final_message()
    starts = [e.content_block for e in events if e.type == "content_block_start"]
    assert [b.type for b in starts] == ["tool_use"] and starts[0].name == CALL_NAME
    partial = "".join(e.delta.partial_json for e in events if e.type == "content_block_delta")
    assert json.loads(partial) == CALL_ARGUMENTS
    assert [(b.type, b.name, b.input) for b in final.content] == [("tool_use", CALL_NAME, CALL_ARGUMENTS)]
    assert final.stop_reason == "tool_use"


def test_anthropic_tool_choice_none_hides_the_tools(claude, ref):
    message = claude.messages.create(model=TOOL_MODEL_ID, max_tokens=16, tools=[CLAUDE_TOOL], tool_choice={"type": "none"},
                                     messages=[{"role": "user", "content": ASK}])
    assert message.content[0].text == ref.chat([{"role": "user", "content": ASK}], 16)
    assert message.stop_reason == "max_tokens"


# -- OpenAI Responses --------------------------------------------------------------------------

def test_responses_tool_loop(client, ref):
    first = client.responses.create(model=TOOL_MODEL_ID, input=ASK, tools=[RESPONSES_TOOL], max_output_tokens=32,
                                    temperature=0)
    (item,) = first.output
    assert item.type == "function_call" and item.name == CALL_NAME and item.status == "completed"
    assert json.loads(item.arguments) == CALL_ARGUMENTS and first.status == "completed"
    second = client.responses.create(model=TOOL_MODEL_ID, tools=[RESPONSES_TOOL], max_output_tokens=24, temperature=0,
                                     input=[{"role": "user", "content": ASK}, item.model_dump(exclude_none=True),
                                            {"type": "function_call_output", "call_id": item.call_id, "output": RESULT}])
    prompt = after_the_call(ref, item.call_id)
    assert second.output_text == ref.generate(prompt, 24) and [o.type for o in second.output] == ["message"]
    assert second.usage.input_tokens == ref.prompt_tokens(prompt)


def test_responses_streamed_function_call(client, ref):
    with client.responses.stream(model=TOOL_MODEL_ID, input=ASK, tools=[RESPONSES_TOOL], max_output_tokens=32,
                                 temperature=0) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.function_call_arguments.delta", "response.function_call_arguments.done",
                     "response.output_item.done", "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    (item,) = final.output
    assert (item.type, item.name, json.loads(item.arguments)) == ("function_call", CALL_NAME, CALL_ARGUMENTS)


# -- Ollama ------------------------------------------------------------------------------------

def test_ollama_tool_loop(llama, ref):
    options = {"temperature": 0, "num_predict": 32}
    first = llama.chat(model=TOOL_MODEL_ID, messages=[{"role": "user", "content": ASK}], tools=[WEATHER_TOOL],
                       options=options)
    (call,) = first.message.tool_calls
    assert call.function.name == CALL_NAME and call.function.arguments == CALL_ARGUMENTS
    assert first.message.content == "" and first.done_reason == "stop"
    second = llama.chat(model=TOOL_MODEL_ID, tools=[WEATHER_TOOL], options=options | {"num_predict": 24}, messages=[
        {"role": "user", "content": ASK}, first.message, {"role": "tool", "content": RESULT, "tool_name": CALL_NAME}])
    prompt = after_the_call(ref, "call_1_0", OLLAMA_TOOL)
    assert second.message.content == ref.generate(prompt, 24) and not second.message.tool_calls
    assert second.prompt_eval_count == ref.prompt_tokens(prompt)


def test_ollama_streamed_tool_call(llama, ref):
    parts = list(llama.chat(model=TOOL_MODEL_ID, messages=[{"role": "user", "content": ASK}], tools=[WEATHER_TOOL],
                            options={"temperature": 0, "num_predict": 32}, stream=True))
    calls = [c for p in parts for c in (p.message.tool_calls or [])]
    assert [(c.function.name, c.function.arguments) for c in calls] == [(CALL_NAME, CALL_ARGUMENTS)]
    assert parts[-1].done and "".join(p.message.content for p in parts) == ""


# -- a required call is enforced: decoding constrained to the model's tool-call format -----------

CITY_TOOL = {"type": "function", "function": {"name": CALL_NAME, "description": "The weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]}}, "required": ["city"],
    "additionalProperties": False}}}


# The model's own call (Paris) is not among this tool's cities: a constraint that let it through
# would be seen. With none valid to write, the tiny model pads the call with JSON's free whitespace.
NOT_PARIS_TOOL = copy.deepcopy(CITY_TOOL)
NOT_PARIS_TOOL["function"]["parameters"]["properties"]["city"]["enum"] = ["Oslo", "Lima"]


def assert_valid(calls: list[tuple[str, dict]], tool: dict = CITY_TOOL) -> None:
    for name, arguments in calls:
        assert name == tool["function"]["name"]
        jsonschema.validate(arguments, tool["function"]["parameters"])


def required_call_of(ref: Reference, tool: dict) -> tuple[str, list[tuple[str, dict]]]:
    """mlx-lm's output after the tool's result, constrained by llguidance itself (not exo's grammar)
    to calls of `tool`, and its complete calls: (the raw text, [(name, arguments)])."""
    prompt = after_the_call(ref, "call_0", tool)
    raw = ref.generate(prompt, 64, logits_processors=[Constrained(ref.tokenizer, tool_call_grammar([tool]))])
    calls = [json.loads(part.split("</tool_call>")[0]) for part in raw.split("<tool_call>")[1:] if "</tool_call>" in part]
    return raw, [(c["name"], c["arguments"]) for c in calls]


@pytest.fixture(scope="module")
def required_call(ref) -> tuple[str, list[tuple[str, dict]]]:
    """After the tool's result the model answers in text; with a call required, mlx-lm constrained
    by llguidance writes this call: (the id of the earlier call, [(name, arguments)])."""
    assert "<tool_call>" not in ref.generate(after_the_call(ref, "call_0", CITY_TOOL), 16)  # unconstrained: text
    raw, calls = required_call_of(ref, CITY_TOOL)
    assert calls, raw
    assert_valid(calls)
    return "call_0", calls


def chat_after_the_call(call_id: str) -> list[dict]:
    call = {"id": call_id, "type": "function", "function": {"name": CALL_NAME, "arguments": json.dumps(CALL_ARGUMENTS)}}
    return [{"role": "user", "content": ASK}, {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": call_id, "content": RESULT}]


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": CALL_NAME}}])
def test_chat_tool_choice_required_or_named_is_enforced(client, required_call, choice):
    call_id, expected = required_call
    reply = client.chat.completions.create(model=TOOL_MODEL_ID, messages=chat_after_the_call(call_id), tools=[CITY_TOOL],
                                           tool_choice=choice, temperature=0, max_tokens=64)
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in reply.choices[0].message.tool_calls or []]
    assert_valid(calls)
    assert calls == expected
    assert reply.choices[0].finish_reason == "tool_calls"


def test_a_required_call_is_never_one_the_schema_forbids(client, ref):
    """The model's favourite call (Paris) is invalid for this tool: exo writes the call llguidance
    allows instead (compact JSON leaves no whitespace to stall in), as the reference does."""
    raw, expected = required_call_of(ref, NOT_PARIS_TOOL)
    assert expected and all(arguments["city"] != "Paris" for _, arguments in expected), raw
    reply = client.chat.completions.create(model=TOOL_MODEL_ID, messages=chat_after_the_call("call_0"),
                                           tools=[NOT_PARIS_TOOL], tool_choice="required", temperature=0, max_tokens=64)
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in reply.choices[0].message.tool_calls or []]
    assert_valid(calls, NOT_PARIS_TOOL)
    assert calls == expected and reply.choices[0].finish_reason == "tool_calls"


@pytest.mark.parametrize("choice", [{"type": "any"}, {"type": "tool", "name": CALL_NAME}])
def test_anthropic_any_or_named_tool_is_enforced(claude, required_call, choice):
    call_id, expected = required_call
    tool = {"name": CALL_NAME, "description": FUNCTION["description"], "input_schema": CITY_TOOL["function"]["parameters"]}
    message = claude.messages.create(model=TOOL_MODEL_ID, max_tokens=64, tools=[tool], tool_choice=choice, messages=[
        {"role": "user", "content": ASK},
        {"role": "assistant", "content": [{"type": "tool_use", "id": call_id, "name": CALL_NAME, "input": CALL_ARGUMENTS}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call_id, "content": RESULT}]}])
    calls = [(b.name, b.input) for b in message.content if b.type == "tool_use"]
    assert_valid(calls)
    assert calls == expected
    assert message.stop_reason == "tool_use"


def test_responses_tool_choice_required_is_enforced(client, required_call):
    call_id, expected = required_call
    tool = {"type": "function", **CITY_TOOL["function"]}
    response = client.responses.create(model=TOOL_MODEL_ID, tools=[tool], tool_choice="required", max_output_tokens=64,
                                       temperature=0, input=[
                                           {"role": "user", "content": ASK},
                                           {"type": "function_call", "call_id": call_id, "name": CALL_NAME,
                                            "arguments": json.dumps(CALL_ARGUMENTS)},
                                           {"type": "function_call_output", "call_id": call_id, "output": RESULT}])
    calls = [(o.name, json.loads(o.arguments)) for o in response.output if o.type == "function_call"]
    assert_valid(calls)
    assert calls == expected


# -- bad requests: a 400 in each surface's shape, no task created ---------------------------------

@pytest.mark.parametrize(("path", "body", "says"), [
    ("/v1/messages", {"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "server tool"),
    ("/v1/messages", {"tools": [{"name": "f"}]}, "input_schema"),
    ("/v1/messages", {"tools": [{"name": "no spaces", "input_schema": {}}]}, "tool names"),
    ("/v1/messages", {"tools": [CLAUDE_TOOL], "tool_choice": {"type": "tool", "name": "other"}}, "names no tool"),
    ("/v1/messages", {"tools": [CLAUDE_TOOL], "tool_choice": {"type": "sometimes"}}, "tool_choice.type"),
    ("/v1/messages", {"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "1", "name": "f", "input": {}}]}]},
     "not supported in a user message"),
    ("/v1/messages", {"messages": [{"role": "user", "content": [{"type": "tool_result", "content": "x"}]}]}, "tool_use_id"),
    ("/v1/responses", {"tools": [{"type": "web_search"}]}, "only 'function'"),
    ("/v1/responses", {"tools": [RESPONSES_TOOL], "tool_choice": {"type": "function", "name": "other"}}, "names no tool"),
    ("/v1/responses", {"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "call_id"),
    ("/v1/responses", {"input": [{"type": "function_call_output", "output": "x"}]}, "call_id"),
    ("/v1/responses", {"input": [{"type": "file_search_call", "id": "x"}]}, "not supported"),
    ("/api/chat", {"tools": [{"type": "function", "function": {"name": "no spaces"}}]}, "function names"),
    ("/v1/responses", {"tools": [{"type": "function", "name": "f", "parameters": {"type": "object", "if": {}}}],
                       "tool_choice": "required"}, "cannot be enforced for these tools"),
    ("/v1/responses", {"tools": [RESPONSES_TOOL], "tool_choice": "required",
                       "text": {"format": {"type": "json_object"}}}, "cannot be combined"),
    ("/api/chat", {"messages": [{"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f",
                                                                                                 "arguments": "x"}}]}]},
     "arguments"),
])
def test_bad_tool_requests_are_400(http, ref, path, body, says):
    base = {"/v1/messages": {"max_tokens": 8, "messages": [{"role": "user", "content": ASK}]},
            "/v1/responses": {"input": ASK}, "/api/chat": {"messages": [{"role": "user", "content": ASK}], "stream": False}}
    before = tasks_of(http)
    response = http.post(path, json={"model": TOOL_MODEL_ID, **base[path], **body})
    assert response.status_code == 400, response.text
    assert says in response.text, response.text
    assert tasks_of(http) == before  # refused before the master: no task was created


def tasks_of(http: httpx.Client) -> set[str]:
    """The ids of the tasks in this node's State (an accepted request's task is there before the
    API hears that the master accepted it)."""
    return set(http.get("/state").json()["tasks"])


def test_a_good_request_is_a_task(http, ref):
    """What the bad requests' check looks for is there when a request does reach the master."""
    before = tasks_of(http)
    response = http.post("/v1/messages", json={"model": TOOL_MODEL_ID, "max_tokens": 1, "tools": [CLAUDE_TOOL],
                                               "messages": [{"role": "user", "content": "Hi"}]})
    assert response.status_code == 200, response.text
    assert len(tasks_of(http) - before) == 1

