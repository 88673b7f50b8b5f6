"""A request's keep_alive, as Ollama's (exo/api/keep_alive.py): parsed strictly, then end to end on
one node with a model placed on demand: 0 unloads right after the request, a 2 s keep_alive after
2 s idle (the next request places it again), a request in flight keeps its model past it, /api/ps
says when it expires, and Ollama's load and unload (no prompt) work. Ollama's own client."""

from __future__ import annotations

import re
import time

import httpx
import ollama
import pytest

from exo.api.errors import ApiError
from exo.api.keep_alive import NEVER, keep_alive_seconds
from exo.core.state import State
from tests.support.cluster import state_of
from tests.support.e2e import Reference, one_model_node
from tests.support.polling import wait_until
from tests.support.tiny_model import TINY_MODEL_ID, make_tiny_model

ASK = "Tell me about the sea."
MESSAGES = [{"role": "user", "content": ASK}]
GREEDY = {"temperature": 0, "num_predict": 8}


@pytest.mark.parametrize(("given", "seconds"), [
    ("5m", 300.0), ("30s", 30.0), ("1h", 3600.0), ("250ms", 0.25), ("1h30m", 5400.0), ("1.5h", 5400.0), ("0", 0.0),
    ("0s", 0.0), (0, 0.0), (2, 2.0), (2.5, 2.5), (-1, NEVER), ("-1m", NEVER), (10**12, NEVER), (None, None)])
def test_keep_alive_reads_as_ollama_reads_it(given, seconds):
    assert keep_alive_seconds(given) == seconds


@pytest.mark.parametrize("given", ["5 minutes", "300", "m", "", "5x", "--5m", True, [5]])
def test_a_keep_alive_ollama_would_refuse_is_a_400_naming_the_field(given):
    with pytest.raises(ApiError) as refused:
        keep_alive_seconds(given, "keep_alive")
    assert (refused.value.status, refused.value.param) == (400, "keep_alive")
    assert f"got {given!r}" in str(refused.value)


model_dir, node = one_model_node(TINY_MODEL_ID, make_tiny_model)


@pytest.fixture(scope="module")
def reference(http, model_dir) -> Reference:
    assert http.post("/models/add", json={"model_id": TINY_MODEL_ID}).status_code == 200
    return Reference(model_dir)


@pytest.fixture
def fresh(node, http, reference):
    """Each test starts and ends with the model not loaded (a failed one's desire deleted)."""
    assert not state_of(node).desires, "an earlier test left its model loaded"
    yield
    for desire_id in state_of(node).desires:
        http.delete(f"/desire/{desire_id}")


def _loaded(state: State) -> bool:
    return any(i.model_id == TINY_MODEL_ID for i in state.instances.values())


def _gone(node) -> bool:
    state = state_of(node)
    return not state.desires and not state.instances


@pytest.mark.slow
def test_keep_alive_0_unloads_the_model_right_after_the_request(node, llama, reference, fresh):
    reply = llama.generate(model=TINY_MODEL_ID, prompt=ASK, options=GREEDY, keep_alive=0)
    answered = time.monotonic()
    assert reply.response == reference.chat(MESSAGES, 8)
    wait_until(lambda: _gone(node), 3, what="the desire and its instance ended")
    assert time.monotonic() - answered < 3
    assert f"unloaded {TINY_MODEL_ID} from " in node.output() and "(keep_alive 0 s)" in node.output()


@pytest.mark.slow
def test_a_2s_keep_alive_unloads_after_2s_idle_and_the_next_request_places_it_again(node, llama, reference, fresh):
    first = llama.chat(model=TINY_MODEL_ID, messages=MESSAGES, options=GREEDY, keep_alive="2s")
    answered = time.monotonic()
    assert first.message.content == reference.chat(MESSAGES, 8)
    (placed,) = state_of(node).instances
    time.sleep(1.0)
    assert placed in state_of(node).instances  # idle 1 s of its 2
    wait_until(lambda: _gone(node), 4, what="unloaded after 2 s idle")
    assert time.monotonic() - answered >= 2.0
    again = llama.chat(model=TINY_MODEL_ID, messages=MESSAGES, options=GREEDY, keep_alive=0)
    assert again.message.content == reference.chat(MESSAGES, 8)
    assert len(re.findall(rf"master: placed {re.escape(TINY_MODEL_ID)} on .+: on demand \(instance ", node.output())) >= 2
    wait_until(lambda: _gone(node), 3, what="the second placement unloaded")


@pytest.mark.slow
def test_a_request_in_flight_keeps_its_model_loaded_past_its_keep_alive(node, llama, fresh):
    started = time.monotonic()
    parts = llama.generate(model=TINY_MODEL_ID, prompt=ASK, options={"num_predict": 30_000}, keep_alive="2s", stream=True)
    for _ in parts:
        if time.monotonic() - started > 4.0:
            break  # generating for twice its keep_alive
    assert _loaded(state_of(node)), "unloaded while its request was generating"
    parts.close()  # the client leaves: the generation is cancelled, and its model idle from now
    ended = time.monotonic()
    time.sleep(1.0)
    assert _loaded(state_of(node)), "unloaded before 2 s idle"
    wait_until(lambda: _gone(node), 4, what="unloaded 2 s after its request ended")
    assert time.monotonic() - ended >= 2.0


def _expires(llama: ollama.Client) -> float:
    (running,) = llama.ps().models
    assert running.expires_at is not None
    return running.expires_at.timestamp()


@pytest.mark.slow
def test_api_ps_says_when_the_model_expires(node, llama, http, fresh):
    llama.generate(model=TINY_MODEL_ID, prompt=ASK, options=GREEDY, keep_alive="10m")
    used_at = time.time()
    assert abs(_expires(llama) - (used_at + 600)) < 1.0
    llama.generate(model=TINY_MODEL_ID, prompt=ASK, options=GREEDY, keep_alive=-1)
    assert http.get("/api/ps").json()["models"][0]["expires_at"] == "2999-01-01T00:00:00Z"
    llama.generate(model=TINY_MODEL_ID, prompt=ASK, options=GREEDY, keep_alive="30m")
    parts = llama.generate(model=TINY_MODEL_ID, prompt=ASK, options={"num_predict": 30_000}, stream=True)
    next(iter(parts))
    time.sleep(1.5)  # in use: it expires keep_alive from now, not from the request's start
    assert abs(_expires(llama) - (time.time() + 1800)) < 1.0
    parts.close()
    llama.generate(model=TINY_MODEL_ID, keep_alive=0)


@pytest.mark.slow
def test_ollamas_load_and_unload_with_no_prompt(node, llama, fresh):
    loaded = llama.generate(model=TINY_MODEL_ID)
    assert (loaded.response, loaded.done, loaded.done_reason) == ("", True, "load")
    state = state_of(node)
    (instance,) = state.instances.values()
    assert state.is_ready(instance) and state.desires[instance.desire_id].on_demand
    unloaded = llama.generate(model=TINY_MODEL_ID, keep_alive=0)
    assert (unloaded.response, unloaded.done, unloaded.done_reason) == ("", True, "unload")
    wait_until(lambda: _gone(node), 3, what="unloaded by keep_alive 0")
    again = llama.generate(model=TINY_MODEL_ID, keep_alive=0)  # nothing loaded: nothing placed only to unload
    assert again.done_reason == "unload" and _gone(node)


@pytest.mark.slow
def test_the_extension_field_and_place_instance_take_a_keep_alive(node, http, reference, fresh):
    for path, body in [("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 8}),
                       ("/v1/messages", {"messages": MESSAGES, "max_tokens": 8})]:
        answer = http.post(path, json={"model": TINY_MODEL_ID, "temperature": 0, "keep_alive": 0, **body})
        assert answer.status_code == 200, answer.text
        wait_until(lambda: _gone(node), 3, what=f"unloaded after {path}")
    asked = time.monotonic()
    placed = http.post("/place_instance", json={"model_id": TINY_MODEL_ID, "keep_alive": "2s"})
    assert placed.status_code == 200, placed.text
    assert state_of(node).desires[placed.json()["command_id"]].keep_alive_s == 2.0
    # Idle counts from readiness: loading took over 3 s in two full runs beside other work, so the
    # bound is loose; that it unloads 2 s after, not at once, is below and in the 2 s test above.
    wait_until(lambda: _gone(node), 30, what="an explicit placement with a keep_alive unloaded when idle")
    assert time.monotonic() - asked >= 2.0  # idle from its placement, never used: not unloaded at once


@pytest.mark.slow
@pytest.mark.parametrize(("path", "body", "param"), [
    ("/api/generate", {"model": TINY_MODEL_ID, "prompt": ASK, "keep_alive": "5 minutes"}, None),
    ("/api/chat", {"model": TINY_MODEL_ID, "messages": MESSAGES, "keep_alive": "soon"}, None),
    ("/v1/chat/completions", {"model": TINY_MODEL_ID, "messages": MESSAGES, "keep_alive": "soon"}, "keep_alive"),
    ("/v1/completions", {"model": TINY_MODEL_ID, "prompt": ASK, "keep_alive": True}, "keep_alive"),
    ("/place_instance", {"model_id": TINY_MODEL_ID, "keep_alive": 0}, "keep_alive")])
def test_a_bad_keep_alive_is_a_400_naming_it(node, http: httpx.Client, path, body, param, fresh):
    refused = http.post(path, json=body)
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert "keep_alive" in (error if isinstance(error, str) else f"{error['message']} {error['param']}")
    if param is not None:
        assert error["param"] == param
    assert not state_of(node).desires
