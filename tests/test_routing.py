"""Cache-aware routing (exo/master/routing.py): a conversation's next turns go to the instance that
served its earlier ones (whose runner holds them in its prompt cache), decided from State alone;
everything else goes to the least busy instance."""

import random

import msgspec

from exo.core.apply import apply
from exo.core.commands import GenerateText, PlaceInstance
from exo.core.conversation import digest_conversation
from exo.core.events import KeySet, TaskFinished
from exo.core.keys import ApiKey
from exo.core.requests import ChatMessage, GenerationParams
from exo.core.state import State
from exo.master.routing import TaskIndex, choose_instance
from exo.master.routing import shared_conversation as shared_digests
from tests.support.as_master import stamped
from tests.test_decide import run, with_node

SYSTEM = ChatMessage(role="system", content="You are a coding agent. " * 20)


def chat(*turns: tuple[str, str], system: bool = True) -> GenerationParams:
    return GenerationParams(messages=[SYSTEM] * system + [ChatMessage(role=r, content=c) for r, c in turns])


def finished(state: State, task_id: str) -> State:
    return apply(state, TaskFinished(task_id=task_id, status="completed"), state.last_seq + 1)


def two_instances() -> tuple[State, list[str]]:
    state, _ = run(with_node(), PlaceInstance(command_id="p1", model_id="org/builtin"))
    state, _ = run(state, PlaceInstance(command_id="p2", model_id="org/builtin"))
    return state, [i.instance_id for i in state.instances_of("org/builtin")]


def ask(state: State, command_id: str, params: GenerationParams, finish: bool = True) -> tuple[State, str]:
    state, (created,) = run(state, GenerateText(command_id=command_id, model_id="org/builtin", params=params))
    if finish:
        state = finished(state, command_id)
    return state, created.task.instance_id


def test_interleaved_conversations_keep_landing_on_the_instance_of_their_first_turn():
    state, _ = two_instances()
    histories: dict[int, list[tuple[str, str]]] = {c: [("user", f"Task {c}: fix bug number {c}.")] for c in range(4)}
    first_instance: dict[int, str] = {}
    n = 0
    for turn in range(4):
        for conversation in (0, 1, 2, 3) if turn % 2 == 0 else (3, 1, 0, 2):  # interleaved, in changing order
            n += 1
            # The first turns run together (their tasks still open): the least busy spreads them.
            state, instance = ask(state, f"g{n}", chat(*histories[conversation]), finish=turn > 0)
            if turn == 0:
                first_instance[conversation] = instance
            assert instance == first_instance[conversation], (turn, conversation)
            histories[conversation] += [("assistant", f"reply {n}"), ("user", f"and then {n}")]
        if turn == 0:
            for k in range(1, 5):
                state = finished(state, f"g{k}")
    assert sorted(first_instance.values()).count(first_instance[0]) == 2  # two conversations per instance


def test_a_shared_system_prompt_alone_does_not_route_and_ties_go_to_the_least_busy():
    state, (first, second) = two_instances()
    state, where = ask(state, "g1", chat(("user", "Hello")), finish=False)
    assert where == first
    # Same system prompt, another conversation: the other instance is less busy.
    state, where = ask(state, "g2", chat(("user", "Something else")), finish=False)
    assert where == second
    # Nothing in common: the least busy (both have one open task: the first).
    state, where = ask(state, "g3", chat(("user", "Third"), system=False), finish=False)
    assert where == first


def test_an_adapters_earlier_turn_does_not_draw_the_bases_request_to_its_instance():
    """An instance of a base serving its adapters keeps each adapter's cache entries apart
    (exo/runner/adapter_rows.py): a turn run under an adapter holds nothing for the bare base."""
    for earlier_model, expected in (("org/builtin", "first"), ("org/builtin:pirate", "second")):
        state, (first, second) = two_instances()
        state, where = ask(state, "g1", chat(("user", "Hello")))
        assert where == first
        task = state.tasks["g1"]
        state = msgspec.structs.replace(state, tasks={**state.tasks, "g1": msgspec.structs.replace(task, model_id=earlier_model)})
        state, where = ask(state, "g2", chat(("user", "Something else")), finish=False)
        assert where == first  # a tie: the first; it is now the busier one
        state, where = ask(state, "g3", chat(("user", "Hello"), ("assistant", "Hi"), ("user", "More")), finish=False)
        assert where == {"first": first, "second": second}[expected], earlier_model


def test_a_busier_instance_still_gets_its_conversation_while_it_has_room():
    state, (first, second) = two_instances()
    state, _ = ask(state, "g1", chat(("user", "Hello")))
    for k in range(3):
        state, where = ask(state, f"busy{k}", chat(("user", f"other {k}"), system=False), finish=False)
    state, where = ask(state, "g2", chat(("user", "Hello"), ("assistant", "Hi"), ("user", "More")))
    assert where == first


def shared_conversation(earlier: GenerationParams, later: GenerationParams) -> int:
    return shared_digests(digest_conversation(earlier), digest_conversation(later), later.prompt)


def test_shared_conversation_counts_leading_messages_past_the_system_prompt():
    earlier = chat(("user", "Hello"))
    assert shared_conversation(earlier, chat(("user", "Hello"), ("assistant", "Hi"), ("user", "x"))) == len(SYSTEM.content) + 7
    assert shared_conversation(earlier, chat(("user", "Goodbye"))) == 0  # the system prompt alone
    assert shared_conversation(earlier, GenerationParams(messages=earlier.messages, tools=[{"type": "function"}])) == 0
    prompt = "Once upon a time, in a small village by the sea,"
    assert shared_conversation(GenerationParams(prompt=prompt), GenerationParams(prompt=prompt + " there")) == len(prompt)
    assert shared_conversation(GenerationParams(prompt="short"), GenerationParams(prompt="short and more")) == 0
    assert shared_conversation(GenerationParams(prompt=prompt), chat(("user", prompt))) == 0


def test_finished_tasks_keep_their_prompt_by_digest_only_and_state_stays_small():
    from exo.core.state import encode_state

    state, _ = two_instances()
    long = "x" * 100_000

    def params(n: int, *more: str) -> GenerationParams:
        turns = [ChatMessage(role="user", content=f"{n}{long}")] + [ChatMessage(role="user", content=m) for m in more]
        return GenerationParams(messages=turns, stop=["y" * 1000] * 16, tools=[{"type": "function", "n": n}])

    for n in range(0, 50, 2):  # two at a time: while both are open, the least busy spreads them
        state, _ = ask(state, f"g{n}", params(n), finish=False)
        state, _ = ask(state, f"g{n + 1}", params(n + 1), finish=False)
        state = finished(finished(state, f"g{n}"), f"g{n + 1}")
    assert state.tasks["g6"].instance_id != state.tasks["g7"].instance_id
    task = state.tasks["g0"]
    assert (task.params.messages, task.params.stop, task.params.tools) == ([], [], [])
    assert len(task.conversation.messages) == 1 and task.conversation.chars == [100_002]
    assert len(encode_state(state)) < 60_000  # 50 prompts of 100 kB (5 MB): the text stays in the log
    # Routing still finds each conversation's instance, from the digests alone.
    for n in (6, 7):
        _, where = ask(state, f"next{n}", params(n, "and on"))
        assert where == state.tasks[f"g{n}"].instance_id


def _random_request(rng: random.Random, n: int) -> GenerationParams:
    """Requests drawn so that many share a system prompt, an opening, tools or a raw prompt's start."""
    if rng.random() < 0.2:  # completions: raw prompts that continue one another
        return GenerationParams(prompt="Once upon a time, in a land far away, " * rng.randint(1, 3) + str(rng.randint(0, 3)))
    system = [SYSTEM] if rng.random() < 0.6 else []
    opening = [ChatMessage(role="user", content=f"topic {rng.randint(0, 5)}")]
    later = [ChatMessage(role=rng.choice(["assistant", "user"]), content=f"turn {rng.randint(0, 2)}")
             for _ in range(rng.randint(0, 3))]
    tools = [{"type": "function", "function": {"name": "f"}}] if rng.random() < 0.2 else []
    only_system = [SYSTEM] if rng.random() < 0.05 else None
    return GenerationParams(messages=only_system or system + opening + later, tools=tools)


def test_the_masters_task_index_changes_no_routing_decision(monkeypatch):
    """Routing with the master's TaskIndex compares a request with the tasks of its chat key only:
    over a long random run (tasks evicted, the index rebuilt, one index across every State), every
    task that shares anything with the request is among those it compares, and the choice is the
    one a scan of every task makes."""
    monkeypatch.setattr("exo.core.apply_tasks.MAX_FINISHED_TASKS", 30)  # evictions, and the index's rebuilds, early
    rng = random.Random(7)
    state, _ = two_instances()
    state, _ = run(state, PlaceInstance(command_id="p3", model_id="org/builtin"))
    candidates = state.instances_of("org/builtin")
    index, compared, rebuilt, seen_before = TaskIndex(), 0, 0, 0
    for n in range(400):
        params = _random_request(rng, n)
        later = digest_conversation(params)
        alike = {t.task_id for t in index.alike(state, later)}
        sharing = {t.task_id for t in state.tasks.values() if shared_digests(t.conversation, later, params.prompt) > 0}
        assert sharing <= alike, n
        compared, rebuilt, seen_before = compared + len(sharing), rebuilt + (index._entries < seen_before), index._entries
        busy = {i.instance_id: rng.randint(0, 2) for i in candidates}
        assert choose_instance(state, candidates, params, busy, index=index) == \
            choose_instance(state, candidates, params, busy), n
        state, _ = ask(state, f"r{n}", params, finish=rng.random() < 0.8)
    finished_kept = sum(t.status == "completed" for t in state.tasks.values())
    assert compared > 200 and finished_kept == 30 and rebuilt >= 1, (compared, finished_kept, rebuilt)


# Cache scopes: a key's conversations attract only its own scope's later turns (exo/core/keys.py).
ALICE, BOB, CAROL = (ApiKey(key_id=f"key_{n:016x}", secret_sha256=f"{n:064x}") for n in (1, 2, 3))


def with_keys(state: State, *keys: ApiKey) -> State:
    for key in keys:
        state = apply(state, stamped(state, KeySet(key=key)), state.last_seq + 1)
    return state


def ask_as(state: State, command_id: str, key: ApiKey | None, params: GenerationParams,
           finish: bool = True) -> tuple[State, str]:
    command = GenerateText(command_id=command_id, model_id="org/builtin", params=params, key_id=key.key_id if key else "")
    state, (created,) = run(state, command)
    return (finished(state, command_id) if finish else state), created.task.instance_id


def served_then_busy(state: State, owner: ApiKey | None) -> State:
    """`owner`'s conversation served on the first instance, which then has one open task more than
    the second: a later turn goes back there only if that conversation attracts it."""
    state, _ = ask_as(state, "secret", owner, chat(("user", "My salary is 123,456 a year.")))
    state, _ = ask_as(state, "busy", None, chat(("user", "unrelated"), system=False), finish=False)
    return state


def test_another_keys_conversation_does_not_attract_a_request_that_repeats_it():
    state, (first, second) = two_instances()
    state = served_then_busy(with_keys(state, ALICE, BOB), ALICE)
    guess = chat(("user", "My salary is 123,456 a year."), ("assistant", "ok"), ("user", "More"))
    _, where = ask_as(state, "bob", BOB, guess)
    assert where == second  # the least busy: Alice's conversation is not Bob's to find
    _, where = ask_as(state, "keyless", None, guess)
    assert where == second  # nor a request without a key's
    _, where = ask_as(state, "alice", ALICE, guess)
    assert where == first  # while Alice's own next turn goes where her conversation is
    assert (state.tasks["secret"].params.cache_scope, state.tasks["busy"].params.cache_scope) == (
        f"key:{ALICE.key_id}", "")


def test_keys_of_one_cache_scope_attract_each_others_conversations():
    state, (first, _) = two_instances()
    team = [msgspec.structs.replace(key, cache_scope="team-a") for key in (ALICE, BOB)]
    state = served_then_busy(with_keys(state, *team, CAROL), team[0])
    guess = chat(("user", "My salary is 123,456 a year."), ("assistant", "ok"), ("user", "More"))
    state, where = ask_as(state, "bob", team[1], guess)
    assert where == first
    assert state.tasks["bob"].params.cache_scope == state.tasks["secret"].params.cache_scope == "scope:team-a"
    _, where = ask_as(state, "carol", CAROL, guess)
    assert where != first


def test_a_command_cannot_choose_its_cache_scope():
    state, (first, second) = two_instances()
    state = served_then_busy(with_keys(state, ALICE, BOB), ALICE)
    forged = msgspec.structs.replace(chat(("user", "My salary is 123,456 a year."), ("assistant", "ok")),
                                     cache_scope=f"key:{ALICE.key_id}")
    state, where = ask_as(state, "bob", BOB, forged)
    assert (where, state.tasks["bob"].params.cache_scope) == (second, f"key:{BOB.key_id}")
