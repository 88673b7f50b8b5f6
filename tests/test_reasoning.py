"""Reasoning split from the answer on every surface, with the official clients against `exo` as
a process and the tiny thinking model (its template opens `<think>`; it writes one thought, then
`</think>`, then text). The split is exactly at the markers of mlx-lm's own output for the same
prompt; thinking turned off through each surface's switch renders the template with
enable_thinking=false and gives mlx-lm's text for that prompt, with no reasoning at all."""

from __future__ import annotations

import json

import pytest

from tests.support.e2e import Reference, one_model_node, place
from tests.support.thinking_model import THINK_END, THINKING_MODEL_ID, THOUGHT, make_thinking_model

pytestmark = pytest.mark.slow

ASK = "Tell me about the sea."
MESSAGES = [{"role": "user", "content": ASK}]
TOKENS = 16


model_dir, node = one_model_node(THINKING_MODEL_ID, make_thinking_model)


@pytest.fixture(scope="module")
def ref(http, model_dir) -> Reference:
    place(http, THINKING_MODEL_ID)
    return Reference(model_dir)


@pytest.fixture(scope="module")
def thought_and_answer(ref) -> tuple[str, str]:
    """mlx-lm's greedy output, split at its markers: (reasoning, content)."""
    raw = ref.chat(MESSAGES, TOKENS)
    assert raw.startswith(THOUGHT + THINK_END) and len(raw) > len(THOUGHT + THINK_END)  # the test can fail
    return THOUGHT, raw.removeprefix(THOUGHT + THINK_END)


@pytest.fixture(scope="module")
def unthinking(ref) -> str:
    """mlx-lm's greedy output for the prompt rendered with enable_thinking=false."""
    prompt = ref.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False, enable_thinking=False)
    assert prompt.endswith(THINK_END)
    return ref.generate(prompt, TOKENS)




def ask(**extra) -> dict:
    return {"model": THINKING_MODEL_ID, "messages": MESSAGES, "max_tokens": TOKENS, "temperature": 0, **extra}


def test_chat_completions_split_reasoning_content(http, thought_and_answer):
    reply = http.post("/v1/chat/completions", json=ask()).json()
    message = reply["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == thought_and_answer
    assert reply["usage"]["completion_tokens"] == TOKENS


def test_streamed_reasoning_comes_first_then_the_answer(client, thought_and_answer):
    chunks = [c for c in client.chat.completions.create(**ask(), stream=True) if c.choices]
    kinds, reasoning, content = [], [], []
    for chunk in chunks:
        delta = chunk.choices[0].delta.model_dump()
        if delta.get("reasoning_content"):
            kinds.append("reasoning")
            reasoning.append(delta["reasoning_content"])
        if delta.get("content"):
            kinds.append("content")
            content.append(delta["content"])
    assert ("".join(reasoning), "".join(content)) == thought_and_answer
    assert kinds == sorted(kinds, key=lambda k: k != "reasoning")  # no reasoning after the answer began


@pytest.mark.parametrize("switch", [{"reasoning_effort": "none"}, {"chat_template_kwargs": {"enable_thinking": False}},
                                    {"enable_thinking": False}])
def test_thinking_off_renders_the_template_without_it(http, unthinking, switch):
    message = http.post("/v1/chat/completions", json=ask(**switch)).json()["choices"][0]["message"]
    assert message["content"] == unthinking and "reasoning_content" not in message


def test_completions_keep_the_raw_text_whole(http, ref):
    prompt = ref.chat_prompt(MESSAGES)
    text = http.post("/v1/completions", json={"model": THINKING_MODEL_ID, "prompt": prompt, "max_tokens": TOKENS,
                                               "temperature": 0}).json()["choices"][0]["text"]
    assert text == ref.generate(prompt, TOKENS) and THINK_END in text


def test_anthropic_thinking_blocks(claude, thought_and_answer, unthinking):
    message = claude.messages.create(model=THINKING_MODEL_ID, max_tokens=TOKENS, messages=MESSAGES)
    assert [b.type for b in message.content] == ["thinking", "text"]
    assert (message.content[0].thinking, message.content[1].text) == thought_and_answer
    with claude.messages.stream(model=THINKING_MODEL_ID, max_tokens=TOKENS, messages=MESSAGES) as stream:
        events = list(stream)
        final = stream.get_final_message()
    deltas = [e.delta.type for e in events if e.type == "content_block_delta"]
    assert deltas == sorted(deltas, key=lambda k: k != "thinking_delta") and "thinking_delta" in deltas
    assert (final.content[0].thinking, final.content[1].text) == thought_and_answer
    off = claude.messages.create(model=THINKING_MODEL_ID, max_tokens=TOKENS, messages=MESSAGES,
                                 thinking={"type": "disabled"})
    assert [(b.type, b.text) for b in off.content] == [("text", unthinking)]


def test_responses_reasoning_item(client, thought_and_answer, unthinking):
    response = client.responses.create(model=THINKING_MODEL_ID, input=ASK, max_output_tokens=TOKENS, temperature=0)
    assert [o.type for o in response.output] == ["reasoning", "message"]
    assert (response.output[0].content[0].text, response.output_text) == thought_and_answer
    events = list(client.responses.create(model=THINKING_MODEL_ID, input=ASK, max_output_tokens=TOKENS, temperature=0,
                                          stream=True))
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == thought_and_answer[0]
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == thought_and_answer[1]
    assert [o.type for o in events[-1].response.output] == ["reasoning", "message"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    off = client.responses.create(model=THINKING_MODEL_ID, input=ASK, max_output_tokens=TOKENS, temperature=0,
                                  reasoning={"effort": "none"})
    assert [o.type for o in off.output] == ["message"] and off.output_text == unthinking


def test_ollama_thinking(llama, thought_and_answer, unthinking):
    options = {"temperature": 0, "num_predict": TOKENS}
    reply = llama.chat(model=THINKING_MODEL_ID, messages=MESSAGES, options=options)
    assert (reply.message.thinking, reply.message.content) == thought_and_answer
    parts = list(llama.chat(model=THINKING_MODEL_ID, messages=MESSAGES, options=options, stream=True))
    assert "".join(p.message.thinking or "" for p in parts) == thought_and_answer[0]
    assert "".join(p.message.content for p in parts) == thought_and_answer[1]
    off = llama.chat(model=THINKING_MODEL_ID, messages=MESSAGES, options=options, think=False)
    assert off.message.content == unthinking and not off.message.thinking


def test_a_cards_unthinking_sampling_applies_when_thinking_is_off(http, model_dir, unthinking):
    card = {"model_id": "local/thinker", "path": str(model_dir), "sampling": {"temperature": 1.5},
            "sampling_no_thinking": {"temperature": 0.0}}
    assert http.post("/models/add", json=card).status_code == 200
    place(http, "local/thinker")
    body = {"model": "local/thinker", "messages": MESSAGES, "max_tokens": TOKENS, "seed": 1}
    off = http.post("/v1/chat/completions", json=body | {"reasoning_effort": "none"}).json()["choices"][0]["message"]
    assert off["content"] == unthinking  # greedy: the card's no-thinking default
    on = http.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
    assert on["reasoning_content"] + on["content"] != THOUGHT + unthinking  # sampled at 1.5


@pytest.mark.parametrize(("path", "body", "says"), [
    ("/v1/chat/completions", ask(reasoning_effort="lots"), "reasoning_effort"),
    ("/v1/chat/completions", ask(chat_template_kwargs={"add_vision_id": True}), "chat_template_kwargs"),
    ("/v1/messages", {"model": THINKING_MODEL_ID, "max_tokens": 8, "messages": MESSAGES, "thinking": {"type": "maybe"}},
     "thinking.type"),
    ("/v1/responses", {"model": THINKING_MODEL_ID, "input": ASK, "reasoning": {"effort": "lots"}}, "reasoning.effort"),
])
def test_bad_thinking_switches_are_400(http, ref, path, body, says):
    response = http.post(path, json=body)
    assert response.status_code == 400 and says in response.text, response.text


def test_a_response_format_constrains_the_answer_not_the_reasoning(http, ref):
    schema = {"type": "object", "properties": {"calm": {"type": "boolean"}, "size": {"type": "integer", "minimum": 0,
                                                                                      "maximum": 99}},
              "required": ["calm", "size"], "additionalProperties": False}
    body = ask(max_tokens=40, response_format={"type": "json_schema", "json_schema": {"name": "sea", "schema": schema}})
    message = http.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
    assert message["reasoning_content"] == THOUGHT  # the thought the model writes unconstrained
    answer = json.loads(message["content"])
    assert set(answer) == {"calm", "size"} and isinstance(answer["calm"], bool) and 0 <= answer["size"] <= 99


def test_a_required_tool_call_is_refused_where_the_format_cannot_be_enforced(http, ref):
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    response = http.post("/v1/chat/completions", json=ask(tools=[tool], tool_choice="required"))
    assert response.status_code == 400, response.text  # this model has no tool-call format mlx-lm knows
    assert "cannot be enforced for this model's tool-call format (none)" in response.json()["error"]["message"]
    assert http.post("/v1/chat/completions", json=ask(tools=[tool])).status_code == 200  # "auto": fine
