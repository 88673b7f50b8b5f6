"""Routing that sees what each prompt cache holds (docs/prompt-cache.md, "What each cache holds"):
runners report their entries by the task whose end stored them, and the tasks whose entries are
gone; the master no longer sends a conversation to an instance only for an entry it has evicted.

The runner's bookkeeping is checked against mlx-lm's own LRUPromptCache (which keys are exact hits
there); routing against the rule it had before reports (a scan of State) where reports say nothing
is gone; end to end, a real eviction on a two-instance node moves the next turn."""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections.abc import Callable, Iterator

import httpx
import mlx.core as mx
import msgspec
import pytest
from mlx_lm.models.cache import ArraysCache, KVCache

from exo.bus.cache_reports import listen_for_cache_reports, publish_cache_report
from exo.bus.connection import connect
from exo.bus.subjects import cache_report_subject
from exo.core.apply import apply
from exo.core.cache_reports import MAX_DROPPED, CacheContents, CacheReport, HeldEntry, rank_zero, report_decoder
from exo.core.commands import GenerateText
from exo.core.events import TaskFinished
from exo.core.ids import InstanceId, NodeId, RunnerId, TaskId
from exo.core.requests import ChatMessage, GenerationParams
from exo.core.state import State
from exo.master.cache_view import CacheView
from exo.master.decide import decide
from exo.runner.prompt_cache import DROPPED_KEPT, PromptCache
from exo.runner.protocol import CacheHeld, encode_line
from exo.worker.cache_reports import report_of
from tests.support.as_master import stamped
from tests.support.cluster import state_of, wait_until
from tests.support.e2e import exo_serving, nats_url_of, place
from tests.support.tiny_model import TINY_MODEL_ID, make_tiny_model
from tests.test_decide import BUILTIN, ids_for
from tests.test_routing import ALICE, BOB, two_instances, with_keys

# The runner's side: which task's entry its cache holds, by mlx-lm's rules.


def kv(tokens: int) -> list[KVCache]:
    """A one-layer KV cache holding `tokens` tokens (what keep() stores; the model does not matter)."""
    layer = KVCache()
    layer.update_and_fetch(mx.zeros((1, 1, tokens, 2)), mx.zeros((1, 1, tokens, 2)))
    return [layer]


def exact_hits(cache: PromptCache, keys: set[tuple[str, tuple[int, ...]]]) -> set[tuple[str, tuple[int, ...]]]:
    """The keys mlx-lm's LRUPromptCache holds as entries: fetch_nearest_cache gives them back whole."""
    lru = cache._lru
    return {(scope, tokens) for scope, tokens in keys if lru.fetch_nearest_cache(scope, list(tokens))[1] == []}


def test_the_entries_it_reports_are_the_entries_mlx_lms_cache_holds():
    rng = random.Random(5)
    cache = PromptCache(None, max_bytes=1 << 40, max_entries=1 << 20)
    tried: set[tuple[str, tuple[int, ...]]] = set()
    owner_of: dict[tuple[str, tuple[int, ...]], str] = {}
    ever_held: set[str] = set()
    for step in range(400):
        if rng.random() < 0.8:  # short token sequences over two ids: prefixes, repeats and branches abound
            key = (rng.choice("ab"), tuple(rng.choice((7, 8)) for _ in range(rng.randint(1, 6))))
            owner = rng.choice(["", *(f"t{n}" for n in range(12))])
            trimmable = rng.random() < 0.9
            layers = kv(len(key[1])) if trimmable else [ArraysCache(1)]  # the latter says no length: not stored
            cache.keep(list(key[1]), layers, scope=key[0], owner=TaskId(owner))
            tried.add(key)
            if trimmable:
                owner_of[key] = owner
        else:
            cache.max_entries = rng.randint(0, 8)
            cache.trim()
        held = exact_hits(cache, tried)
        assert len(held) == cache.entries, step
        contents = cache.contents
        owners = {owner_of[k] for k in held} - {""}
        assert {e.task_id for e in contents.held} == owners, step
        assert {e.task_id: e.tokens for e in contents.held} == {
            o: max(len(k[1]) for k in held if owner_of[k] == o) for o in owners}, step
        ever_held |= owners
        assert not set(contents.dropped) & owners and "" not in contents.dropped, step
    assert set(cache.contents.dropped) >= ever_held - {e.task_id for e in cache.contents.held}
    assert len(ever_held) == 12


def test_a_task_whose_cache_is_not_stored_is_reported_dropped_and_the_list_is_bounded():
    off = PromptCache(None, max_bytes=0)
    off.keep([1, 2, 3], kv(3), scope="", owner=TaskId("t1"))
    assert off.contents == CacheContents(dropped=[TaskId("t1")])
    cache = PromptCache(None, max_bytes=1 << 40, max_entries=1)
    for n in range(DROPPED_KEPT + 5):
        cache.keep([n + 10], kv(1), scope="", owner=TaskId(f"t{n}"))
        cache.trim()
    assert cache.contents.held == [HeldEntry(task_id=TaskId(f"t{DROPPED_KEPT + 4}"), tokens=1)]
    assert cache.contents.dropped == [TaskId(f"t{n}") for n in range(4, DROPPED_KEPT + 4)]  # the latest, oldest first
    assert DROPPED_KEPT <= MAX_DROPPED
    # Ids as long as a report admits: the latest that fit in a line the worker reads (64 KiB at most).
    for n in range(DROPPED_KEPT + 5):
        cache.keep([n + 10], kv(1), scope="", owner=TaskId(f"{n:0256d}"))
        cache.trim()
    line = encode_line(CacheHeld(contents=cache.contents))
    assert 40_000 < len(line) < 1 << 16 and cache.contents.held == [HeldEntry(task_id=f"{DROPPED_KEPT + 4:0256d}", tokens=1)]
    assert cache.contents.dropped[-1] == f"{DROPPED_KEPT + 3:0256d}"


# The master's side: routing with and without reports.

SYSTEM = ChatMessage(role="system", content="You are a coding agent. " * 20)


def chat(*turns: str) -> GenerationParams:
    return GenerationParams(messages=[SYSTEM] + [ChatMessage(role="user" if n % 2 == 0 else "assistant", content=c)
                                                 for n, c in enumerate(turns)])


def ask(state: State, command_id: str, params: GenerationParams, *, finish: bool = True, key_id: str = "",
        dropped: dict[InstanceId, set[TaskId]] | None = None) -> tuple[State, str]:
    command = GenerateText(command_id=command_id, model_id="org/builtin", params=params, key_id=key_id)
    (created,) = decide(state, command, builtin_cards=BUILTIN, ids=ids_for(command_id), cache_dropped=dropped or {})
    state = apply(state, stamped(state, created), state.last_seq + 1)
    if finish:
        state = apply(state, TaskFinished(task_id=command_id, status="completed"), state.last_seq + 1)
    return state, created.task.instance_id


def conversation_then_busy(key_id: str = "") -> tuple[State, str, str]:
    """A conversation's first turn served on the first instance, which then has an open task more
    than the second: its next turn goes back there only if that first turn attracts it."""
    state, (first, second) = two_instances()
    state = with_keys(state, ALICE, BOB)
    state, where = ask(state, "turn1", chat("Fix the bug in parse()."), key_id=key_id)
    state, busy = ask(state, "busy", GenerationParams(messages=[ChatMessage(role="user", content="unrelated")]),
                      finish=False)
    assert where == busy == first
    return state, first, second


def test_an_evicted_entry_no_longer_attracts_its_conversation_and_a_held_one_does():
    state, first, second = conversation_then_busy()
    turn2 = chat("Fix the bug in parse().", "Done.", "Now the tests.")
    assert ask(state, "t2", turn2)[1] == first  # no report: State's inference, as before
    assert ask(state, "t2", turn2, dropped={first: set()})[1] == first  # the report holds it (or says nothing of it)
    assert ask(state, "t2", turn2, dropped={second: {TaskId("turn1")}})[1] == first  # another instance's word
    assert ask(state, "t2", turn2, dropped={first: {TaskId("turn1")}})[1] == second  # gone: the least busy
    # An open task's entry is not stored yet: a report cannot have dropped it.
    state, where = ask(state, "turn1b", chat("Refactor main()."), finish=False)
    assert where == second  # the first is busier; now both have one open task, and a tie goes to the first
    assert ask(state, "t3", chat("Refactor main().", "Ok.", "More."), dropped={second: {TaskId("turn1b")}})[1] == second


def test_the_longest_prefix_still_held_wins():
    state, first, second = conversation_then_busy()
    # A branch of the conversation served on the second instance (while the first reported turn1 gone).
    state, where = ask(state, "branch", chat("Fix the bug in parse().", "Done.", "Why?"),
                       dropped={first: {TaskId("turn1")}})
    assert where == second
    later = chat("Fix the bug in parse().", "Done.", "Why?", "Because.", "Go on.")
    assert ask(state, "later", later)[1] == second  # the branch shares the most
    # The branch evicted there, turn1 still held on the first: the shorter prefix that is there wins,
    # busier as the first is.
    assert ask(state, "later", later, dropped={second: {TaskId("branch")}})[1] == first
    assert ask(state, "later", later, dropped={second: {TaskId("branch")}, first: {TaskId("turn1")}})[1] == second


def test_cache_scopes_still_apply_with_reports():
    state, first, second = conversation_then_busy(key_id=ALICE.key_id)
    guess = chat("Fix the bug in parse().", "Done.", "Now the tests.")
    held = {first: set[TaskId]()}  # the first instance reports it holds Alice's turn
    assert ask(state, "bob", guess, key_id=BOB.key_id, dropped=held)[1] == second
    assert ask(state, "alice", guess, key_id=ALICE.key_id, dropped=held)[1] == first


def report_for(state: State, of: str, **changes) -> CacheReport:
    shard = rank_zero(state.instances[InstanceId(of)])
    assert shard is not None
    report = CacheReport(instance_id=InstanceId(of), node_id=shard.node_id, runner_id=shard.runner_id,
                         contents=CacheContents(dropped=[TaskId("turn1")]))
    return msgspec.structs.replace(report, **changes)


def test_the_master_takes_a_report_only_from_where_the_instances_rank_0_runs():
    state, first, second = conversation_then_busy()
    view = CacheView()
    for forged in (report_for(state, first, node_id=NodeId("elsewhere")),
                   report_for(state, first, runner_id=RunnerId("another-runner")),
                   report_for(state, first, instance_id=InstanceId("no-such-instance"))):
        assert not view.accept(state, forged)
    assert (view.dropped, view.refused) == ({}, 3)
    assert view.accept(state, report_for(state, first))
    assert view.dropped == {first: {"turn1"}} and view.held(InstanceId(first)) == {}
    turn2 = chat("Fix the bug in parse().", "Done.", "Now the tests.")
    assert ask(state, "t2", turn2, dropped=dict(view.dropped))[1] == second


def test_the_worker_reports_rank_0_runners_only_and_tasks_state_has():
    state, first, _ = conversation_then_busy()
    shard = rank_zero(state.instances[InstanceId(first)])
    assert shard is not None
    contents = CacheContents(held=[HeldEntry(task_id=TaskId("busy"), tokens=5), HeldEntry(task_id=TaskId("old"))],
                             dropped=[TaskId("long-gone"), TaskId("turn1")])
    report = report_of(state, shard.node_id, shard.runner_id, contents)
    assert report == CacheReport(instance_id=InstanceId(first), node_id=shard.node_id, runner_id=shard.runner_id,
                                 contents=CacheContents(held=[HeldEntry(task_id=TaskId("busy"), tokens=5)],
                                                        dropped=[TaskId("turn1")]))
    assert report_of(state, NodeId("other-node"), shard.runner_id, contents) is None
    assert report_of(state, shard.node_id, RunnerId("unknown"), contents) is None


@pytest.mark.asyncio
async def test_only_well_formed_reports_on_their_instances_subject_are_heard(nc):
    heard: list[CacheReport] = []
    subscription = await listen_for_cache_reports(nc, heard.append)
    good = CacheReport(instance_id=InstanceId("i1"), node_id=NodeId("n1"), runner_id=RunnerId("r1"),
                       contents=CacheContents(dropped=[TaskId("t1")]))
    encoded = msgspec.json.encode(good)
    try:
        for subject, data in [
            (cache_report_subject(InstanceId("i2")), encoded),  # names another instance than its subject
            (cache_report_subject(InstanceId("i1")), b"not json"),
            (cache_report_subject(InstanceId("i1")), encoded.replace(b'"kind":"cache_report"', b'"kind":"pulse"')),
            (cache_report_subject(InstanceId("i1")), encoded[:-1] + b',"extra":1}'),
            (cache_report_subject(InstanceId("i1")), msgspec.json.encode(msgspec.structs.replace(
                good, contents=CacheContents(dropped=[TaskId(f"t{n}") for n in range(MAX_DROPPED + 1)])))),
            (cache_report_subject(InstanceId("i1")), msgspec.json.encode(msgspec.structs.replace(
                good, contents=CacheContents(held=[HeldEntry(task_id=TaskId("x" * 300))])))),
        ]:
            await nc.publish(subject, data)
        await publish_cache_report(nc, good)
        await nc.flush()
        deadline = time.monotonic() + 5
        while not heard and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)
        assert heard == [good]
        assert report_decoder.decode(encoded) == good
    finally:
        await subscription.unsubscribe()


# End to end: two instances of the tiny model on one node, each runner caching one entry.


class ReportTap:
    """Every cache report published on the node's NATS, heard on a thread of its own."""

    def __init__(self, nats_url: str) -> None:
        self.reports: list[CacheReport] = []
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(nats_url,), daemon=True)
        self._thread.start()
        assert self._ready.wait(30), "no NATS connection"

    def _run(self, nats_url: str) -> None:
        asyncio.set_event_loop(self._loop)

        async def connect_and_listen() -> None:
            self.nc = await connect([nats_url], name="test-cache-reports")
            await listen_for_cache_reports(self.nc, self.reports.append)
            self._ready.set()

        self._loop.run_until_complete(connect_and_listen())
        self._loop.run_forever()

    def publish(self, report: CacheReport) -> None:
        asyncio.run_coroutine_threadsafe(publish_cache_report(self.nc, report), self._loop).result(10)

    def wait_for(self, instance_id: str, holds: Callable[[CacheContents], bool], what: str) -> None:
        wait_until(lambda: any(r.instance_id == instance_id and holds(r.contents) for r in self.reports), 20, 0.1,
                   what=what)

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.nc.close(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    model_dir = make_tiny_model(tmp_path_factory.mktemp("tiny") / "model")
    with exo_serving(tmp_path_factory.mktemp("node"), {TINY_MODEL_ID: model_dir},
                     {"EXO_PROMPT_CACHE_ENTRIES": "1"}) as exo:
        yield exo


def turn(http: httpx.Client, messages: list[dict], max_tokens: int = 8) -> tuple[str, dict]:
    answer = http.post("/v1/chat/completions", json={"model": TINY_MODEL_ID, "messages": messages,
                                                     "temperature": 0, "max_tokens": max_tokens})
    assert answer.status_code == 200, answer.text
    body = answer.json()
    return body["id"].removeprefix("chatcmpl-"), body


def instance_of(node, task_id: str) -> str:
    return state_of(node).tasks[TaskId(task_id)].instance_id


@pytest.fixture
def busy(node) -> Iterator[Callable[[], str]]:
    """Starts a long streamed generation (on whichever instance the router picks) and returns its task
    id once it runs; what is still running at the end is cancelled."""
    started: list[str] = []
    with httpx.Client(base_url=node.url, timeout=120) as http:
        def start() -> str:
            first_event: list[str] = []

            def stream() -> None:
                body = {"model": TINY_MODEL_ID, "stream": True, "max_tokens": 4000, "temperature": 0,
                        "messages": [{"role": "user", "content": f"Write a long story, number {len(started)}."}]}
                with http.stream("POST", "/v1/chat/completions", json=body) as response:
                    for line in response.iter_lines():
                        if line.startswith("data: {") and not first_event:
                            first_event.append(msgspec.json.decode(line[6:])["id"].removeprefix("chatcmpl-"))

            threading.Thread(target=stream, daemon=True).start()
            task_id: str = wait_until(lambda: first_event[0] if first_event else None, 30, 0.05,
                                      what="the long generation to start")
            started.append(task_id)
            return task_id

        yield start
        for task_id in started:
            http.post(f"/v1/cancel/{task_id}")


def ended(node, task_id: str) -> bool:
    return state_of(node).tasks[TaskId(task_id)].status not in ("pending", "running")


@pytest.mark.slow  # starts exo, with two instances
def test_an_evicted_conversation_is_no_longer_sent_to_its_instance_and_a_forged_report_is_ignored(node, busy):
    with httpx.Client(base_url=node.url, timeout=120) as http:
        first = place(http, TINY_MODEL_ID)
        second = place(http, TINY_MODEL_ID)
        wait_until(lambda: all(r.status == "ready" for r in state_of(node).runners.values())
                   and len(state_of(node).runners) == 2, 120, 0.2, what="both instances ready")
        tap = ReportTap(nats_url_of(node))
        try:
            # A forged report (another node's word) that the first instance dropped a turn it holds: ignored.
            held_turn = [{"role": "user", "content": "Tell me about the sea."}]
            task, body = turn(http, held_turn)
            assert instance_of(node, task) == first  # both idle: the first
            tap.wait_for(first, lambda c: any(e.task_id == task for e in c.held), "the first runner to hold it")
            shard = rank_zero(state_of(node).instances[InstanceId(first)])
            assert shard is not None
            long_one = busy()
            assert instance_of(node, long_one) == first
            # Right before the next turn: the worker's own report, resent every 10 s, would replace it.
            tap.publish(CacheReport(instance_id=InstanceId(first), node_id=NodeId("forged-node"),
                                    runner_id=shard.runner_id, contents=CacheContents(dropped=[TaskId(task)])))
            time.sleep(0.3)  # the forged report has reached the master if it ever will
            next_turn = [*held_turn, {"role": "assistant", "content": body["choices"][0]["message"]["content"]},
                         {"role": "user", "content": "And the river?"}]
            task2, _ = turn(http, next_turn)
            assert instance_of(node, task2) == first  # still attracted, busier as it is
            http.post(f"/v1/cancel/{long_one}")
            wait_until(lambda: ended(node, long_one), 60, 0.1, what="the long generation to end")

            # A real eviction: one entry per runner, and an unrelated request takes the first's place.
            evicted_turn = [{"role": "user", "content": "Once upon a time"}]
            task3, body3 = turn(http, evicted_turn)
            assert instance_of(node, task3) == first
            filler, _ = turn(http, [{"role": "user", "content": "What is the capital of France?"}])
            assert instance_of(node, filler) == first
            tap.wait_for(first, lambda c: task3 in c.dropped, "the first runner to report the eviction")
            time.sleep(0.2)  # the master heard it too (it listens from the start)
            long_two = busy()
            assert instance_of(node, long_two) == first
            next_turn = [*evicted_turn, {"role": "assistant", "content": body3["choices"][0]["message"]["content"]},
                         {"role": "user", "content": "Go on."}]
            task4, _ = turn(http, next_turn)
            assert instance_of(node, task4) == second  # nothing of it is cached on the first: the least busy
        finally:
            tap.close()
