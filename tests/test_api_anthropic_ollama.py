"""The Anthropic and Ollama surfaces with their official clients against `exo` as a process:
greedy text equals mlx-lm's, and errors come in each surface's own shape."""

from __future__ import annotations

import anthropic
import ollama
import pytest

from tests.support.e2e import Reference, one_model_node, place
from tests.support.tiny_model import TINY_MODEL_ID, make_tiny_model

pytestmark = pytest.mark.slow

SYSTEM = "You are terse."
ASK = "Tell me about the sea."
MESSAGES = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": ASK}]


model_dir, node = one_model_node(TINY_MODEL_ID, make_tiny_model)


@pytest.fixture(scope="module")
def tiny(http, model_dir) -> Reference:
    place(http, TINY_MODEL_ID)
    return Reference(model_dir)




def test_anthropic_messages_equal_mlx_lm(claude, tiny):
    # No temperature: this SDK no longer sends one, and the card has no sampling defaults: greedy.
    message = claude.messages.create(model=TINY_MODEL_ID, system=SYSTEM, max_tokens=24,
                                     messages=[{"role": "user", "content": ASK}])
    assert message.type == "message" and message.role == "assistant"
    assert [block.type for block in message.content] == ["text"]
    assert message.content[0].text == tiny.chat(MESSAGES, 24)
    assert message.stop_reason == "max_tokens" and message.stop_sequence is None
    assert message.usage.input_tokens == tiny.prompt_tokens(tiny.chat_prompt(MESSAGES))
    assert message.usage.output_tokens == 24


def test_anthropic_stream_sends_its_event_sequence(claude, tiny):
    with claude.messages.stream(model=TINY_MODEL_ID, system=[{"type": "text", "text": SYSTEM}], max_tokens=24,
                                messages=[{"role": "user", "content": [{"type": "text", "text": ASK}]}]) as stream:
        events = list(stream)
        final = stream.get_final_message()
    kinds = [e.type for e in events if e.type != "text"]  # "text" events are the SDK's own convenience
    assert kinds[:3] == ["message_start", "content_block_start", "content_block_delta"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert "".join(e.delta.text for e in events if e.type == "content_block_delta") == tiny.chat(MESSAGES, 24)
    assert final.content[0].text == tiny.chat(MESSAGES, 24) and final.stop_reason == "max_tokens"
    assert final.usage.output_tokens == 24
    # The same prompt as the test before: all but its last token come from the runner's prompt
    # cache, which Anthropic's usage counts apart from input_tokens.
    prompt = tiny.prompt_tokens(tiny.chat_prompt(MESSAGES))
    assert (final.usage.input_tokens, final.usage.cache_read_input_tokens) == (1, prompt - 1)
    assert final.usage.cache_creation_input_tokens == 0


def test_anthropic_stop_sequences_report_which_one_stopped_it(claude, tiny):
    text = tiny.chat(MESSAGES, 24)
    stop = text[10:13]
    message = claude.messages.create(model=TINY_MODEL_ID, system=SYSTEM, max_tokens=24,
                                     stop_sequences=["never-there", stop], messages=[{"role": "user", "content": ASK}])
    assert message.content[0].text == text[: text.index(stop)]
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == stop


def test_anthropic_errors_are_anthropic_shaped(claude, http, tiny):
    with pytest.raises(anthropic.NotFoundError) as missing:
        claude.messages.create(model="nobody/nothing", max_tokens=4, messages=[{"role": "user", "content": "x"}])
    assert missing.value.body["type"] == "error" and missing.value.body["error"]["type"] == "not_found_error"
    for body in [{"model": TINY_MODEL_ID, "messages": [{"role": "user", "content": "x"}]},  # no max_tokens
                 {"model": TINY_MODEL_ID, "max_tokens": 4, "messages": [{"role": "system", "content": "x"}]},
                 {"model": TINY_MODEL_ID, "max_tokens": 4, "temperature": 1.5, "messages": [{"role": "user", "content": "x"}]},
                 {"model": TINY_MODEL_ID, "max_tokens": 4, "messages": [
                     {"role": "user", "content": [{"type": "image", "source": {}}]}]}]:
        response = http.post("/v1/messages", json=body)
        assert response.status_code == 400, response.text
        assert response.json()["type"] == "error" and response.json()["error"]["type"] == "invalid_request_error"


def test_ollama_chat_equals_mlx_lm(llama, tiny):
    options = {"temperature": 0, "num_predict": 24}
    reply = llama.chat(model=TINY_MODEL_ID, messages=MESSAGES, options=options)
    assert reply.message.role == "assistant" and reply.message.content == tiny.chat(MESSAGES, 24)
    assert reply.done and reply.done_reason == "length" and reply.eval_count == 24
    assert reply.prompt_eval_count == tiny.prompt_tokens(tiny.chat_prompt(MESSAGES))
    parts = list(llama.chat(model=TINY_MODEL_ID, messages=MESSAGES, options=options, stream=True))
    assert "".join(p.message.content for p in parts) == tiny.chat(MESSAGES, 24)
    assert [p.done for p in parts] == [False] * (len(parts) - 1) + [True]


def test_ollama_generate_applies_the_template_unless_raw(llama, tiny):
    options = {"temperature": 0, "num_predict": 16}
    reply = llama.generate(model=TINY_MODEL_ID, prompt=ASK, system=SYSTEM, options=options)
    assert reply.response == tiny.chat(MESSAGES, 16) and reply.done_reason == "length"
    raw = llama.generate(model=TINY_MODEL_ID, prompt="Once upon a time", raw=True, options=options)
    assert raw.response == tiny.generate("Once upon a time", 16)
    parts = list(llama.generate(model=TINY_MODEL_ID, prompt=ASK, system=SYSTEM, options=options, stream=True))
    assert "".join(p.response for p in parts) == tiny.chat(MESSAGES, 16) and parts[-1].done


def test_ollama_lists_shows_and_reports_running_models(llama, tiny):
    assert TINY_MODEL_ID in [m.model for m in llama.list().models]
    assert [m.model for m in llama.ps().models] == [TINY_MODEL_ID]
    shown = llama.show(TINY_MODEL_ID)
    assert shown.modelinfo["general.block_count"] == 2 and shown.details.format == "mlx"


def test_ollama_errors_are_ollama_shaped(llama, http, tiny):
    with pytest.raises(ollama.ResponseError) as missing:
        llama.chat(model="nobody/nothing", messages=[{"role": "user", "content": "x"}])
    assert missing.value.status_code == 404 and "not found" in missing.value.error
    assert http.get("/api/version").json()["version"]
    for path, body in [("/api/chat", {"model": TINY_MODEL_ID, "messages": []}),
                       ("/api/chat", {"model": TINY_MODEL_ID, "messages": [{"role": "x", "content": "y"}]}),
                       ("/api/chat", {"model": TINY_MODEL_ID, "messages": [{"role": "user"}], "format": "yaml"}),
                       ("/api/generate", {"model": TINY_MODEL_ID, "prompt": "x", "options": {"temperature": "hot"}}),
                       ("/api/show", {"model": "nobody/nothing"})]:
        response = http.post(path, json=body)
        assert response.status_code in (400, 404), response.text
        assert isinstance(response.json()["error"], str)
