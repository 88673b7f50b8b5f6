"""EXO_ADAPTERS_SHARE_BASE: requests for "<base>:<adapter>" served by the one instance of their
base, each row through its own adapter, with exactly the text mlx-lm gives with that adapter loaded
alone (`mlx_lm.load(adapter_path=...)`); an adapter added while the instance serves is used by the
next request without another instance; the prompt cache never lends one adapter's KV to another."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import mlx_lm
import openai
import pytest

from exo.core.commands import DeleteAdapter, GenerateText
from exo.core.events import AdapterDeleting, TaskCreated
from exo.core.requests import ChatMessage, GenerationParams
from exo.core.state import State
from exo.core.types import Instance, SamplingDefaults, ShardAssignment
from exo.master.decide import decide
from exo.runner.adapter_rows import ResidentAdapters, adapter_scoped
from exo.runner.decoding import Output, RequestRefused
from exo.runner.engine import Engine
from exo.settings.services import RunnerSettings
from tests.support.adapters import make_adapter
from tests.support.e2e import Reference, exo_serving, place
from tests.support.tiny_model import TINY_MODEL_ID, make_tiny_model
from tests.test_adapters import CARD, _adapter, _objects, upload

ASK = [{"role": "user", "content": "Tell me about the sea and the ships upon it."}]
MAX_TOKENS = 24
# Different seeds, ranks and layers: stacked per layer with ranks padded (multi_lora.py).
ADAPTERS = {"pirate": {"seed": 7, "rank": 4}, "poet": {"seed": 11, "rank": 8, "num_layers": 1},
            "clerk": {"seed": 13, "rank": 2}, "late": {"seed": 17, "rank": 4}, "doomed": {"seed": 19, "rank": 4}}
LONG_TOKENS = 600  # a generation still running while the DELETE is asked and a new request refused


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("model") / "tiny")


@pytest.fixture(scope="module")
def adapter_dirs(tmp_path_factory, model_dir):
    return {name: make_adapter(model_dir, tmp_path_factory.mktemp(name) / name, **options)
            for name, options in ADAPTERS.items()}


@pytest.fixture(scope="module")
def references(model_dir, adapter_dirs):
    return {None: Reference(model_dir), **{name: Reference(model_dir, folder) for name, folder in adapter_dirs.items()}}


@pytest.fixture(scope="module")
def http(tmp_path_factory, model_dir, adapter_dirs):
    """EXO_ADAPTERS_SHARE_BASE left at its default (on): the tests below check what it does by default."""
    with exo_serving(tmp_path_factory.mktemp("node"), {TINY_MODEL_ID: model_dir},
                     env={"EXO_RESIDENT_ADAPTERS": "3"}) as node, \
            httpx.Client(base_url=node.url, timeout=300) as client:
        place(client, TINY_MODEL_ID)
        for name in ("pirate", "poet", "clerk"):
            assert upload(client, name, adapter_dirs[name]).status_code == 200
        client.base_url_v1 = f"{node.url}/v1"  # type: ignore[attr-defined]
        client.node = node  # type: ignore[attr-defined]
        yield client


def _ask(http: httpx.Client, adapter: str | None, messages: list[dict[str, str]] = ASK) -> str:
    model = TINY_MODEL_ID if adapter is None else f"{TINY_MODEL_ID}:{adapter}"
    client = openai.OpenAI(base_url=http.base_url_v1, api_key="unused")  # type: ignore[attr-defined]
    answer = client.chat.completions.create(model=model, messages=messages, max_tokens=MAX_TOKENS, temperature=0)
    assert answer.model == model
    return answer.choices[0].message.content or ""


def _instances(http: httpx.Client) -> list[str]:
    return [i["model_id"] for i in http.get("/state").json()["instances"].values()]


@pytest.mark.slow
def test_three_adapters_and_the_bare_base_share_one_instance_each_with_mlx_lms_text(http, references):
    rows = [None, "pirate", "poet", "clerk"]
    with ThreadPoolExecutor(len(rows)) as pool:
        answers = list(pool.map(lambda adapter: _ask(http, adapter), rows))
    expected = [references[adapter].chat(ASK, MAX_TOKENS) for adapter in rows]
    assert answers == expected
    assert len(set(expected)) == len(rows)  # every adapter is at work, each its own
    assert _instances(http) == [TINY_MODEL_ID]


@pytest.mark.slow
def test_an_adapter_added_while_serving_is_used_by_the_next_request_without_an_instance(http, adapter_dirs, references):
    assert upload(http, "late", adapter_dirs["late"]).status_code == 200
    assert _ask(http, "late") == references["late"].chat(ASK, MAX_TOKENS)  # one of 3 resident had to go
    assert _ask(http, "pirate") == references["pirate"].chat(ASK, MAX_TOKENS)
    assert _instances(http) == [TINY_MODEL_ID]


@pytest.mark.slow
def test_the_same_prompt_under_two_adapters_gets_each_adapters_own_text(http, references):
    """The second and third requests find the first's prompt in the cache: only their own adapter's may serve."""
    messages = [{"role": "user", "content": "Write a long letter about the harbour, the gulls and the tide."}]
    for adapter in ("poet", "clerk", None, "poet"):
        assert _ask(http, adapter, messages) == references[adapter].chat(messages, MAX_TOKENS), adapter


def _stream_text(lines: Iterator[str], until_first: bool = False) -> str:
    """The content of an SSE chat stream's deltas: all of it, or (`until_first`) its first piece."""
    text = ""
    for line in lines:
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        text += json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
        if until_first and text:
            break
    return text


def _soon(check: Callable[[], object], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "not within the timeout"
        time.sleep(0.05)


@pytest.mark.slow
def test_deleting_an_adapter_in_use_waits_for_its_request_which_ends_with_mlx_lms_text(http, references, adapter_dirs):
    assert upload(http, "doomed", adapter_dirs["doomed"]).status_code == 200
    bad_wait = http.delete("/adapters/doomed", params={"wait": "soon"})
    assert bad_wait.status_code == 400 and bad_wait.json()["error"]["param"] == "wait", bad_wait.text
    digest = http.get("/adapters/doomed").json()["digest"]
    model = f"{TINY_MODEL_ID}:doomed"
    body = {"model": model, "messages": ASK, "max_tokens": LONG_TOKENS, "temperature": 0, "stream": True}
    with ThreadPoolExecutor(1) as pool, http.stream("POST", "/v1/chat/completions", json=body) as stream, \
            httpx.Client(base_url=http.base_url, timeout=300) as other:
        lines = stream.iter_lines()
        text = _stream_text(lines, until_first=True)  # it runs
        at_once = http.delete("/adapters/doomed", params={"wait": 0})
        assert at_once.status_code == 202, at_once.text
        assert at_once.json()["deleting"] and at_once.json()["requests"] == 1
        waiting = pool.submit(other.delete, "/adapters/doomed")  # a second DELETE, waiting for the same end
        _soon(lambda: http.get("/adapters/doomed").json()["deleting"])
        refused = http.post("/v1/chat/completions", json={"model": model, "messages": ASK, "max_tokens": 4})
        assert refused.status_code == 404 and "being deleted" in refused.json()["error"]["message"], refused.text
        assert model not in [m["id"] for m in http.get("/v1/models").json()["data"]]
        assert not waiting.done()
        text += _stream_text(lines)
        answer = waiting.result(timeout=60)
    assert text == references["doomed"].chat(ASK, LONG_TOKENS)  # ran to its exact end
    assert answer.status_code == 200 and answer.json()["message"] == "adapter deleted", answer.text
    assert http.get("/adapters/doomed").status_code == 404
    assert digest not in _objects(http.node)  # type: ignore[attr-defined]  # deleted before the 200


# --- in process and pure ---

@pytest.fixture(scope="module")
def engine(model_dir) -> Engine:
    engine = Engine(RunnerSettings(resident_adapters=2))
    engine.load(str(model_dir))
    return engine


def _alone(engine: Engine, adapter_path: str, task_id: str) -> str:
    out: list[Output] = []
    params = adapter_scoped(GenerationParams(messages=[ChatMessage(role="user", content=ASK[0]["content"])],
                                             max_tokens=MAX_TOKENS, temperature=0), adapter_path)
    with engine.adapters.alone(engine.model, adapter_path, task_id):
        engine.generate(params, SamplingDefaults(), out.append, lambda: False)
    return "".join(o.text for o in out)


@pytest.mark.slow
def test_the_single_path_applies_the_requests_adapter_only_while_it_runs(engine, adapter_dirs, references):
    for adapter in ("pirate", None, "poet", "clerk", "pirate", None):  # 3 adapters through 2 resident slots
        path = str(adapter_dirs[adapter]) if adapter else ""
        assert _alone(engine, path, "t") == references[adapter].chat(ASK, MAX_TOKENS), adapter
    assert engine.adapters.multi is not None and not engine.adapters.multi.batch.rows  # nothing left selected


def test_a_resident_adapter_a_running_row_holds_is_never_evicted(model_dir, adapter_dirs):
    model, _ = mlx_lm.load(str(model_dir))  # its own: the engine's holds the other tests' adapters
    adapters = ResidentAdapters(limit=1)
    pirate, poet = str(adapter_dirs["pirate"]), str(adapter_dirs["poet"])
    held = adapters.hold(model, pirate, "row 1")
    with pytest.raises(RequestRefused, match="all 1 resident adapters are in use"):
        adapters.hold(model, poet, "row 2")
    assert adapters.resident == (held,) and adapters.held_by("row 1") == held
    adapters.release("row 1")
    assert adapters.hold(model, poet, "row 2") == adapter_dirs["poet"].name
    assert adapters.resident == (adapter_dirs["poet"].name,)
    adapters.release("row 2")
    adapters.hold(model, pirate, "row 3")  # the base as it was: its linears unwrapped as the adapters left
    adapters.release("row 3")


def _one_node(instance_id: str, model_id: str, nodes: int = 1) -> Instance:
    shards = [ShardAssignment(runner_id=f"{instance_id}-r{n}", node_id=f"n{n}", rank=n, world_size=nodes)
              for n in range(nodes)]
    return Instance(instance_id=instance_id, model_id=model_id, shards=shards)


def test_the_master_sends_an_adapter_to_an_instance_of_its_base_unless_turned_off(adapter_dirs):
    adapter = _adapter(adapter_dirs["pirate"])
    state = State(adapters={"pirate": adapter},
                  instances={"two": _one_node("two", TINY_MODEL_ID, nodes=2), "one": _one_node("one", TINY_MODEL_ID)})
    command = GenerateText(command_id="g", model_id=adapter.model_id, params=GenerationParams())

    def run(state: State, share: bool | None) -> list:
        chosen = {} if share is None else {"adapters_share_base": share}  # None: the default
        return decide(state, command, builtin_cards={TINY_MODEL_ID: CARD}, ids=iter(["x"] * 10), on_demand=False,
                      **chosen)

    assert run(state, None) == run(state, True)  # on by default
    [created] = run(state, True)
    assert isinstance(created, TaskCreated) and created.task.instance_id == "one"
    assert created.task.model_id == adapter.model_id  # the task names its adapter
    assert not isinstance(run(state, False)[0], TaskCreated)  # off: as before, an instance of its own
    running = State(adapters={"pirate": adapter}, instances=state.instances, tasks={"g": created.task})
    [marked] = decide(running, DeleteAdapter(command_id="d", name="pirate"), builtin_cards={}, ids=iter(["x"]))
    assert isinstance(marked, AdapterDeleting)  # deleted once the request ends (tests/test_adapter_delete.py)
    multi_node_only = State(adapters={"pirate": adapter}, instances={"two": _one_node("two", TINY_MODEL_ID, nodes=2)})
    [on_ranks] = run(multi_node_only, True)  # its ranks select adapters per row too (tests/test_adapters_on_ranks.py)
    assert isinstance(on_ranks, TaskCreated) and on_ranks.task.instance_id == "two"
