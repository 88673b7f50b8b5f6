"""A request that places its model on demand and waits for it, when the wait is long or goes wrong:
Ollama streams are told it is loading (chunks with no text), a placement whose download fails ends
the request as a failed `wait` placement does (424), and one that never becomes ready ends at
EXO_LOAD_TIMEOUT_S. One exo process on a fake Hub; each model is a copy of the tiny one, loaded
cold by one test only."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from exo.core.node_names import node_label
from tests.support.cluster import state_of
from tests.support.e2e import Reference, start_exo
from tests.support.exo_process import ExoProcess
from tests.support.fake_hub import FakeHub
from tests.support.tiny_model import make_tiny_model

CHAT_MODEL = "exo-test/ollama-chat"
GENERATE_MODEL = "exo-test/ollama-generate"
GONE, GONE_TOO = "exo-test/gone", "exo-test/gone-too"  # one per surface: a failed instance refuses the next request
SLOW = "exo-test/slow"
LOAD_TIMEOUT_S = 5  # on a node of its own: a cold load of the tiny model may take longer on a busy machine
MESSAGES = [{"role": "user", "content": "Tell me about the sea."}]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("model") / "tiny-llama")


@pytest.fixture(scope="module")
def expected(tiny: Path) -> str:
    return Reference(tiny).chat(MESSAGES, MAX_TOKENS)


@pytest.fixture(scope="module")
def hub(tiny: Path) -> Iterator[FakeHub]:
    with FakeHub({model: tiny for model in (CHAT_MODEL, GENERATE_MODEL, GONE, GONE_TOO, SLOW)}) as fake:
        yield fake


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory, hub: FakeHub) -> Iterator[ExoProcess]:
    exo = start_exo(tmp_path_factory.mktemp("node"), hub, {"EXO_LOADING_NOTE_S": "0.2"})
    try:
        with httpx.Client(base_url=exo.url, timeout=60) as http:
            for model in (CHAT_MODEL, GENERATE_MODEL, GONE, GONE_TOO):
                assert http.post("/models/add", json={"model_id": model}).status_code == 200
        for model in (GONE, GONE_TOO):
            del hub.repos[model]  # its card stays: a placement of it fails in its download
        yield exo
    finally:
        exo.interrupt()


@pytest.fixture
def http(node: ExoProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=node.url, timeout=60) as client:
        yield client


def _stream_lines(http: httpx.Client, path: str, body: dict) -> list[dict]:
    with http.stream("POST", path, json=body) as answer:
        assert answer.status_code == 200
        return [json.loads(line) for line in answer.iter_lines() if line]


@pytest.mark.slow
@pytest.mark.parametrize(("path", "model", "field"), [("/api/chat", CHAT_MODEL, "message"),
                                                      ("/api/generate", GENERATE_MODEL, "response")])
def test_an_ollama_stream_is_told_with_empty_chunks_while_its_model_loads(http, expected, path, model, field):
    body = {"model": model, "stream": True, "options": {"temperature": 0, "num_predict": MAX_TOKENS}}
    lines = _stream_lines(http, path, body | ({"messages": MESSAGES} if field == "message"
                                              else {"prompt": MESSAGES[0]["content"]}))

    def text(line: dict) -> str:
        return str(line["message"]["content"] if field == "message" else line["response"])

    first_token = next(n for n, line in enumerate(lines) if text(line))
    empty = {"role": "assistant", "content": ""} if field == "message" else ""
    notes = lines[:first_token]
    assert notes, lines  # a cold load takes seconds: several notes at 0.2 s
    assert [set(line) for line in notes] == [{"model", "created_at", field, "done"}] * len(notes), notes
    assert all((n["model"], n[field], n["done"]) == (model, empty, False) for n in notes), notes
    assert all(isinstance(n["created_at"], str) and n["created_at"].endswith("Z") for n in notes), notes
    assert "".join(text(line) for line in lines) == expected  # the notes added nothing to the text
    assert lines[-1]["done"] is True and [line["done"] for line in lines[:-1]] == [False] * (len(lines) - 1)


@pytest.mark.slow
def test_a_placement_on_demand_whose_download_fails_ends_the_request_as_a_failed_wait_placement(http, node):
    started = time.monotonic()
    answer = http.post("/v1/chat/completions", json={"model": GONE, "messages": MESSAGES, "max_tokens": MAX_TOKENS})
    assert time.monotonic() - started < 10  # at once: no load timeout to wait for
    assert answer.status_code == 424, answer.text
    error = answer.json()["error"]
    node_id = http.get("/node_id").json()
    assert error == {"message": f"instance {error['instance_id']} failed on node {node_id}: download failed: "
                                f"{_gone_reason(GONE)}",
                     "type": "download_error", "param": "model", "code": "not_found",
                     "instance_id": error["instance_id"], "node_id": node_id}
    ollama = http.post("/api/chat", json={"model": GONE_TOO, "messages": MESSAGES, "stream": False})
    assert ollama.status_code == 424, ollama.text
    (instance_id,) = [i for i, instance in http.get("/state").json()["instances"].items()
                      if instance["model_id"] == GONE_TOO]
    assert ollama.json() == {"error": f"instance {instance_id} failed on node {node_id}: download failed: "
                                      f"{_gone_reason(GONE_TOO)}"}


def _gone_reason(model: str) -> str:
    return f"repository not found on the Hub: {model} (a private one needs HF_TOKEN)"


@pytest.mark.slow
def test_a_request_whose_instance_never_becomes_ready_ends_at_the_load_timeout(tmp_path, hub):
    node = start_exo(tmp_path, hub, {"EXO_LOAD_TIMEOUT_S": str(LOAD_TIMEOUT_S)})
    try:
        answer, waited = _ask_while_downloads_crawl(node, hub)
        state = state_of(node)
    finally:
        node.interrupt()
    assert LOAD_TIMEOUT_S <= waited < LOAD_TIMEOUT_S + 5, waited
    (instance,) = [i for i in state.instances.values() if i.model_id == SLOW]
    assert not state.is_ready(instance)  # placed, still on its way: not a wait for a placement
    (this_node,) = state.nodes.values()
    assert (answer.status_code, answer.json()["error"]) == (504, {
        "message": f"no instance of {SLOW!r} was ready for it (waited {LOAD_TIMEOUT_S} s, the most EXO_LOAD_TIMEOUT_S "
                   f"allows: loading {SLOW} on {node_label(this_node)})",
        "type": "timeout_error", "param": None, "code": None})


def _ask_while_downloads_crawl(node: ExoProcess, hub: FakeHub) -> tuple[httpx.Response, float]:
    with httpx.Client(base_url=node.url, timeout=LOAD_TIMEOUT_S + 20) as http:
        assert http.post("/models/add", json={"model_id": SLOW}).status_code == 200
        hub.throttle_bps = 40_000  # the weights take 12 s to come: the instance is placed, its runner not ready
        try:
            started = time.monotonic()
            answer = http.post("/v1/chat/completions", json={"model": SLOW, "messages": MESSAGES, "max_tokens": 2})
            return answer, time.monotonic() - started
        finally:
            hub.throttle_bps = None
