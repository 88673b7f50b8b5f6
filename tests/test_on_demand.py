"""A request for a model with no instance places one on demand and queues on it (exo/master/decide.py):
pure decisions first, then one node end to end (the tiny model from a fake Hub, text exact vs mlx-lm)."""

from __future__ import annotations

import itertools
import re
import threading
import time
from pathlib import Path

import httpx
import pytest

from exo.core.commands import GenerateText
from exo.core.events import CommandRejected, DesireSet, InstanceCreated, NodeRegistered, TaskCreated, TaskFinished
from exo.core.state import State
from exo.core.types import Desire, ModelCard, NodeInfo, ShardAssignment
from exo.master.decide import decide
from exo.master.heal import HealLimits, waiting_tasks
from tests.support.as_master import fold
from tests.support.cluster import state_of
from tests.support.e2e import Reference, start_exo
from tests.support.fake_hub import FakeHub
from tests.support.tiny_model import TINY_MODEL_ID, make_tiny_model

MODEL = "org/m"
CARDS = {MODEL: ModelCard(model_id=MODEL, n_layers=4, storage_bytes=1000)}


def ids_for(command_id: str):
    return (f"{command_id}-{n}" for n in itertools.count())


def one_node(memory: int = 10_000) -> State:
    return fold([NodeRegistered(node=NodeInfo(node_id="n1", memory_available=memory))])


def ask(state: State, command_id: str, *, on_demand: bool = True, cards: dict = CARDS) -> list:
    return decide(state, GenerateText(command_id=command_id, model_id=MODEL, at=7.0), builtin_cards=cards,
                  ids=ids_for(command_id), on_demand=on_demand)


def test_a_request_with_no_instance_places_one_on_demand_and_queues_on_it():
    placed, desire, created = ask(one_node(), "g1")
    assert desire == DesireSet(command_id="g1-0", desire=Desire(desire_id="g1-0", model_id=MODEL, on_demand=True,
                                                                keep_alive_s=300.0, last_used_at=7.0,
                                                                min_replicas=0, max_replicas=1))
    assert isinstance(placed, InstanceCreated) and placed.command_id == "g1-0"
    assert placed.instance.desire_id == "g1-0" and placed.instance.model_id == MODEL
    assert placed.instance.shards == [ShardAssignment(runner_id="g1-1", node_id="n1", start_layer=0, end_layer=4,
                                                      memory_bytes=1000, kv_bytes=placed.instance.shards[0].kv_bytes)]
    assert isinstance(created, TaskCreated) and created.command_id == "g1"
    assert (created.task.task_id, created.task.instance_id, created.task.created_at) == ("g1", placed.instance.instance_id, 7.0)


def test_a_second_request_queues_on_the_instance_the_first_placed():
    state = fold(ask(one_node(), "g1"), one_node())
    (instance,) = state.instances.values()
    assert [e.task.instance_id for e in ask(state, "g2") if isinstance(e, TaskCreated)] == [instance.instance_id]
    assert len(ask(state, "g2")) == 1  # the task only: no second desire, no second instance


def test_a_request_waits_for_the_instance_of_an_on_demand_desire_that_has_none_yet():
    state = fold([DesireSet(desire=Desire(desire_id="d", model_id=MODEL, on_demand=True, waiting="no room"))], one_node())
    (created,) = ask(state, "g1")
    assert isinstance(created, TaskCreated) and created.task.instance_id == ""


def test_an_explicit_desire_with_no_instance_still_refuses_with_why_it_waits():
    state = fold([DesireSet(desire=Desire(desire_id="d", model_id=MODEL, waiting="no room"))], one_node())
    (refused,) = ask(state, "g1")
    assert refused == CommandRejected(command_id="g1", command_kind="generate_text", code="unavailable",
                                      reason=f"no instance of {MODEL!r} is running; its placement d is waiting for one: "
                                             "no room")


def test_on_demand_off_in_the_cluster_or_on_the_card_refuses_as_before():
    (off,) = ask(one_node(), "g1", on_demand=False)
    assert off.reason == f"no instance of {MODEL!r} is running; place one first" and off.code == "unavailable"
    cards = {MODEL: ModelCard(model_id=MODEL, n_layers=4, storage_bytes=1000, on_demand=False)}
    (card_off,) = ask(one_node(), "g1", cards=cards)
    assert card_off.code == "unavailable"
    assert card_off.reason == f"no instance of {MODEL!r} is running; place one first (its card says on_demand = false)"


def test_a_model_that_cannot_be_placed_is_refused_with_the_placements_reason():
    (refused,) = ask(one_node(memory=10), "g1")
    assert isinstance(refused, CommandRejected) and refused.code == "conflict"
    assert refused.reason.startswith(f"no instance of {MODEL!r} is running and none can be placed on demand: "
                                     f"{MODEL} needs 1.0 kB;"), refused.reason


def test_a_request_waiting_for_an_on_demand_instance_ends_after_the_load_timeout():
    state = fold([DesireSet(desire=Desire(desire_id="d", model_id=MODEL, on_demand=True, waiting="no room")),
                  *ask(fold([DesireSet(desire=Desire(desire_id="d", model_id=MODEL, on_demand=True))], one_node()), "g1")],
                 one_node())
    limits = HealLimits(load_timeout_s=30, deadline_s=5)
    assert waiting_tasks(state, now=7.0 + 29.9, limits=limits) == []  # the load timeout, not the migration deadline
    assert waiting_tasks(state, now=7.0 + 30, limits=limits) == [TaskFinished(
        task_id="g1", status="failed", finish_reason="error",
        error=f"no instance of {MODEL!r} was ready for it (waited 30 s, the most EXO_LOAD_TIMEOUT_S allows: no room)")]


# End to end: one node, the tiny model from a fake Hub, its card added but never placed.

MESSAGES = [{"role": "user", "content": "Tell me about the sea."}]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("model") / "tiny-llama")


@pytest.fixture(scope="module")
def hub(tiny: Path):
    with FakeHub({TINY_MODEL_ID: tiny}) as fake:
        yield fake


def _node(root: Path, hub: FakeHub, env: dict[str, str] | None = None):
    root.mkdir(exist_ok=True)
    node = start_exo(root, hub, env)
    http = httpx.Client(base_url=node.url, timeout=120)
    assert http.post("/models/add", json={"model_id": TINY_MODEL_ID}).status_code == 200
    return node, http


def _chat(http: httpx.Client, **extra: object) -> httpx.Response:
    return http.post("/v1/chat/completions", json={"model": TINY_MODEL_ID, "messages": MESSAGES,
                                                   "max_tokens": MAX_TOKENS, "temperature": 0, **extra})


@pytest.mark.slow
def test_a_fresh_node_answers_a_card_never_placed_with_mlx_lms_text_and_one_instance(tmp_path, hub, tiny):
    node, http = _node(tmp_path, hub, {"EXO_LOADING_NOTE_S": "0.2"})
    try:
        expected = Reference(tiny).chat(MESSAGES, MAX_TOKENS)
        answers: list[httpx.Response] = []
        streamed: list[str] = []

        def stream() -> None:
            with http.stream("POST", "/v1/chat/completions", json={"model": TINY_MODEL_ID, "messages": MESSAGES,
                                                                   "max_tokens": MAX_TOKENS, "stream": True}) as lines:
                streamed.extend(lines.iter_lines())

        threads = [threading.Thread(target=lambda: answers.append(_chat(http))), threading.Thread(target=stream)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        (answer,) = answers
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["message"]["content"] == expected
        (instance,) = state_of(node).instances.values()  # two first requests at once: one instance
        (desire,) = state_of(node).desires.values()
        assert desire.on_demand and instance.desire_id == desire.desire_id
        first_token = next(n for n, line in enumerate(streamed) if '"content":"' in line and '"content":""' not in line)
        notes = [line for line in streamed[:first_token] if line.startswith(": loading ")]
        assert notes and notes[0].startswith(f": loading {TINY_MODEL_ID} on "), streamed[:first_token]
        assert re.search(rf"master: placed {re.escape(TINY_MODEL_ID)} on .+: on demand \(instance ", node.output())
    finally:
        http.close()
        node.interrupt()


@pytest.mark.slow
def test_on_demand_off_or_a_card_that_says_so_keeps_the_503(tmp_path, hub, tiny):
    node, http = _node(tmp_path / "off", hub, {"EXO_ON_DEMAND": "0"})
    try:
        refused = _chat(http)
        assert refused.status_code == 503 and "place one first" in refused.json()["error"]["message"], refused.text
    finally:
        http.close()
        node.interrupt()
    node, http = _node(tmp_path / "card", hub)
    try:
        card = {"model_id": "local/not-on-demand", "path": str(tiny), "on_demand": False}
        assert http.post("/models/add", json=card).status_code == 200
        refused = http.post("/v1/chat/completions", json={"model": "local/not-on-demand", "messages": MESSAGES})
        assert refused.status_code == 503, refused.text
        assert refused.json()["error"]["message"].endswith("place one first (its card says on_demand = false)")
        time.sleep(0.5)
        assert state_of(node).instances == {}
    finally:
        http.close()
        node.interrupt()
