"""API keys' limits as the master enforces them, with the clock injected: requests per minute in a
sliding window, concurrent requests, tokens per minute, daily and monthly quotas that reset at
their UTC period; scopes; and usage by key, day and model folded from the log."""

from __future__ import annotations

import calendar

import pytest
from msgspec.structs import replace

from exo.core.apply import apply
from exo.core.commands import CancelTask, DeleteKey, GenerateText
from exo.core.events import (
    CommandRejected,
    Event,
    KeyDeleted,
    KeySet,
    TaskCancelRequested,
    TaskCreated,
    TaskFinished,
    TaskMigrated,
    TaskStarted,
)
from exo.core.keys import ApiKey, KeyLimits
from exo.core.requests import ChatMessage, GenerationParams, TranscribeInputs
from exo.core.reservations import reserved_tokens
from exo.core.state import State
from exo.core.types import Instance, ModelCard, ShardAssignment, Task
from exo.core.usage import UsageCounts, day_of
from exo.master.decide import decide
from exo.worker.fairness import next_to_forward

MODEL = "org/model"
CARDS = {MODEL: ModelCard(model_id=MODEL, n_layers=2), "org/other": ModelCard(model_id="org/other", n_layers=2)}
KEY = ApiKey(key_id="key_0123456789abcdef", secret_sha256="a" * 64, models=["org/m*"])
T0 = float(calendar.timegm((2026, 12, 31, 23, 58, 10)))  # near a minute, a day, a month and a year's end
SHORT = GenerationParams(max_tokens=16)  # reserves 80 tokens (an empty chat's allowance, 64, + 16): fits a limit of 100


class Cluster:
    """State with an instance of MODEL and the key, commands decided and their events folded in order."""

    def __init__(self, limits: KeyLimits) -> None:
        self.state = State(leader_term=1)
        instances = {f"i-{m}": Instance(instance_id=f"i-{m}", model_id=m, max_queue=10_000,
                                        shards=[ShardAssignment(runner_id=f"r-{m}", node_id="n")]) for m in CARDS}
        self.state = replace(self.state, instances=instances)
        self.fold(KeySet(key=replace(KEY, limits=limits), term=1))
        self.count = 0

    def fold(self, event: Event) -> None:
        self.state = apply(self.state, replace(event, term=1), self.state.last_seq + 1)  # type: ignore[arg-type]

    def ask(self, at: float, model: str = MODEL, key_id: str = KEY.key_id,
            params: GenerationParams = SHORT) -> CommandRejected | TaskCreated:
        self.count += 1
        command = GenerateText(command_id=f"c{self.count}", model_id=model, at=at, key_id=key_id, params=params)
        [event] = decide(self.state, command, builtin_cards=CARDS, ids=iter([]))
        self.fold(event)
        assert isinstance(event, (CommandRejected, TaskCreated))
        return event

    def finish(self, created: CommandRejected | TaskCreated, prompt: int, completion: int) -> None:
        assert isinstance(created, TaskCreated)
        self.fold(TaskFinished(task_id=created.task.task_id, status="completed", prompt_tokens=prompt,
                               completion_tokens=completion))


def refused(event: CommandRejected | TaskCreated) -> CommandRejected:
    assert isinstance(event, CommandRejected) and event.code == "rate_limited", event
    return event


def test_requests_per_minute_is_a_sliding_window():
    cluster = Cluster(KeyLimits(requests_per_minute=3))
    for n in range(3):
        assert isinstance(cluster.ask(T0 + n), TaskCreated)
    late = refused(cluster.ask(T0 + 10))
    assert "made 3 requests in the last minute" in late.reason and late.retry_after_s == pytest.approx(50)
    assert isinstance(cluster.ask(T0 + 60.5), TaskCreated)  # the first left the window
    refused(cluster.ask(T0 + 60.6))
    assert isinstance(cluster.ask(T0 + 61.5), TaskCreated)


def test_concurrent_requests_count_the_open_ones():
    cluster = Cluster(KeyLimits(concurrent_requests=2))
    first, _ = cluster.ask(T0), cluster.ask(T0)
    assert "2 requests open" in refused(cluster.ask(T0)).reason
    cluster.finish(first, 5, 5)
    assert isinstance(cluster.ask(T0), TaskCreated)


def test_a_cancelled_task_no_longer_counts_against_concurrent_requests():
    cluster = Cluster(KeyLimits(concurrent_requests=1))
    first = cluster.ask(T0)
    assert isinstance(first, TaskCreated)
    refused(cluster.ask(T0))
    cluster.fold(TaskFinished(task_id=first.task.task_id, status="cancelled", finish_reason="cancelled"))
    assert isinstance(cluster.ask(T0), TaskCreated)


def test_a_running_task_asked_to_cancel_counts_until_it_ends():
    cluster = Cluster(KeyLimits(concurrent_requests=1))
    first = cluster.ask(T0)
    assert isinstance(first, TaskCreated)
    cluster.fold(TaskStarted(task_id=first.task.task_id))
    [cancel] = decide(cluster.state, CancelTask(command_id="cancel", task_id=first.task.task_id), builtin_cards=CARDS,
                      ids=iter([]))
    cluster.fold(cancel)
    asked_to_cancel = cluster.state.tasks[first.task.task_id]
    assert (asked_to_cancel.status, asked_to_cancel.cancel_requested) == ("running", True)
    assert "1 requests open" in refused(cluster.ask(T0)).reason


def test_a_request_of_n_choices_counts_n_against_concurrent_requests():
    cluster = Cluster(KeyLimits(concurrent_requests=4))
    three = cluster.ask(T0, params=replace(SHORT, n=3))
    assert isinstance(three, TaskCreated)
    assert refused(cluster.ask(T0, params=replace(SHORT, best_of=2))).reason == (
        f"key {KEY.key_id} has 3 requests open, and this one's 2 choices (n or best_of) count as 2, its limit of 4 "
        "concurrent requests (a request of n choices counts n)")
    assert isinstance(cluster.ask(T0), TaskCreated)  # 3 + 1 = 4
    assert refused(cluster.ask(T0)).reason == (f"key {KEY.key_id} has 4 requests open, its limit of 4 concurrent "
                                               "requests (a request of n choices counts n)")
    cluster.finish(three, 5, 5)
    never = refused(cluster.ask(T0, params=replace(SHORT, n=5)))
    assert never.reason == (f"key {KEY.key_id}: this request's 5 choices (n or best_of) count as 5 requests, more than "
                            "its limit of 4 concurrent requests: send a smaller n")


def test_tokens_per_minute_count_finished_requests_in_the_minute_they_started():
    cluster = Cluster(KeyLimits(tokens_per_minute=100))
    cluster.finish(cluster.ask(T0), 60, 50)  # 110 tokens, counted in T0's minute
    late = refused(cluster.ask(T0 + 5))
    assert "used 110 tokens this minute" in late.reason and late.retry_after_s == pytest.approx(45)
    assert isinstance(cluster.ask(T0 + 50.0), TaskCreated)  # the next minute


@pytest.mark.parametrize(("limits", "period_end", "words"), [
    (KeyLimits(tokens_per_day=100), calendar.timegm((2027, 1, 1, 0, 0, 0)), "tokens today (UTC), its daily quota"),
    (KeyLimits(tokens_per_month=100), calendar.timegm((2027, 1, 1, 0, 0, 0)), "this month (UTC), its monthly quota"),
])
def test_quotas_reset_at_their_utc_period(limits, period_end, words):
    cluster = Cluster(limits)
    cluster.finish(cluster.ask(T0), 70, 40)
    late = refused(cluster.ask(T0 + 100))
    assert words in late.reason and late.retry_after_s == pytest.approx(period_end - (T0 + 100))
    assert isinstance(cluster.ask(period_end + 1), TaskCreated)


def test_a_month_counts_its_days_only():
    cluster = Cluster(KeyLimits(tokens_per_month=100))
    cluster.finish(cluster.ask(calendar.timegm((2026, 11, 30, 12, 0, 0))), 90, 90)  # November's
    assert isinstance(cluster.ask(T0), TaskCreated)


def test_a_key_is_refused_a_model_outside_its_patterns_and_once_deleted():
    cluster = Cluster(KeyLimits())
    rejected = cluster.ask(T0, model="org/other")
    assert isinstance(rejected, CommandRejected) and rejected.code == "unauthorized"
    assert "may not use 'org/other'" in rejected.reason
    cluster.fold(KeyDeleted(key_id=KEY.key_id))
    gone = cluster.ask(T0)
    assert isinstance(gone, CommandRejected) and "was deleted" in gone.reason


def test_usage_is_folded_by_key_day_and_model():
    cluster = Cluster(KeyLimits())
    cluster.finish(cluster.ask(T0), 10, 20)
    cluster.finish(cluster.ask(T0 + 200), 1, 2)  # the next day (UTC) and year
    open_one = cluster.ask(T0 + 201)
    assert isinstance(open_one, TaskCreated)
    assert cluster.state.usage == {KEY.key_id: {
        "2026-12-31": {MODEL: UsageCounts(requests=1, prompt_tokens=10, completion_tokens=20)},
        "2027-01-01": {MODEL: UsageCounts(requests=2, prompt_tokens=1, completion_tokens=2)},
    }}
    assert cluster.state.usage_totals == {KEY.key_id: {MODEL: UsageCounts(requests=3, prompt_tokens=11,
                                                                           completion_tokens=22)}}
    assert day_of(T0) == "2026-12-31"


def test_a_transcriptions_audio_seconds_are_counted_once_it_completes():
    cluster = Cluster(KeyLimits())
    speech = GenerationParams(transcribe=TranscribeInputs(audio="a" * 64, seconds=2.25))
    cluster.finish(cluster.ask(T0, params=speech), 0, 7)
    cluster.finish(cluster.ask(T0 + 1, params=speech), 0, 5)
    failed = cluster.ask(T0 + 2, params=GenerationParams(transcribe=TranscribeInputs(audio="b" * 64, seconds=4.0)))
    assert isinstance(failed, TaskCreated)
    cluster.fold(TaskFinished(task_id=failed.task.task_id, status="failed", error="the runner died"))
    cluster.finish(cluster.ask(T0 + 3), 3, 4)  # a chat: tokens, no audio
    counts = UsageCounts(requests=4, prompt_tokens=3, completion_tokens=16, audio_seconds=4.5)
    assert cluster.state.usage == {KEY.key_id: {day_of(T0): {MODEL: counts}}}
    assert cluster.state.usage_totals == {KEY.key_id: {MODEL: counts}}


# --- fairness: what a runner is given next ---

def _task(n: int, key_id: str, priority: str = "interactive") -> Task:
    return Task(task_id=f"t{n}", instance_id="i", model_id=MODEL, created_at=T0 + n, key_id=key_id, priority=priority)


def test_a_keys_single_request_goes_ahead_of_another_keys_flood():
    flood = [_task(n, "key_a") for n in range(100)]
    lone = _task(200, "key_b")  # asked last
    assert next_to_forward([*flood[2:], lone], flood[:2], 3) == [lone]  # a batch of 3, 2 of it taken
    assert [t.key_id for t in next_to_forward([*flood[2:], lone], [], 4)] == ["key_a", "key_b", "key_a", "key_a"]
    assert next_to_forward(flood[2:], flood[:2], 2) == []


def test_the_interactive_tier_goes_before_the_batch_tier():
    batch = [_task(n, "key_a", "batch") for n in range(3)]
    interactive = _task(10, "key_b")
    assert next_to_forward([*batch, interactive], [], 2) == [interactive, batch[0]]


def test_the_worker_gives_its_runner_a_batchs_worth_and_keeps_the_rest():
    from exo.worker.plan import ForwardTask, LocalRunner, WorkerView, plan

    instance = Instance(instance_id="i", model_id=MODEL, shards=[ShardAssignment(runner_id="r", node_id="n")])
    tasks = {t.task_id: t for t in [_task(n, "key_a") for n in range(5)]}
    state = State(instances={"i": instance}, tasks=tasks)
    local = LocalRunner(runner_id="r", instance_id="i", phase="ready", forwarded=frozenset({"t0"}))
    view = WorkerView(node_id="n", state=state, runners={"r": local}, batch_slots=3)
    assert [s.task_id for s in plan(view) if isinstance(s, ForwardTask)] == ["t1", "t2"]
    unbounded = replace(view, batch_slots=0)
    assert [s.task_id for s in plan(unbounded) if isinstance(s, ForwardTask)] == ["t1", "t2", "t3", "t4"]


def test_a_keys_fields_are_bounded():
    assert "at most 10000" in (KeyLimits(requests_per_minute=20_000).problem() or "")
    assert "between 0 (no limit)" in (KeyLimits(tokens_per_day=-1).problem() or "")
    assert "at most 200 characters" in (replace(KEY, models=["x" * 201]).problem() or "")
    assert replace(KEY, key_id="key_x").problem() == "invalid key id 'key_x'"


# --- token limits under concurrency: open requests reserve their most tokens ---

HI = GenerationParams(prompt="hi", max_tokens=40)  # a raw prompt: reserves 2 bytes + 2 (BOS, EOS) + 40 = 44 tokens


def test_reservations_bound_the_prompt_and_the_answer_within_the_context():
    chat = GenerationParams(messages=[ChatMessage(role="user", content="héllo")], max_tokens=10)
    assert reserved_tokens(chat, 0) == 64 + 8 + 6 + 10  # the template's allowance, a message's, its UTF-8 bytes
    assert reserved_tokens(HI, 0) == 44
    assert reserved_tokens(HI, 30) == 30  # never more than the context
    assert reserved_tokens(replace(HI, max_tokens=None), 1000) == 1000  # no max_tokens: what the context leaves
    assert reserved_tokens(replace(HI, max_tokens=None), 0) == 4 + 2048  # unknown context: the runner's default


def test_a_request_of_n_choices_reserves_its_prompt_once_and_each_choices_answer():
    assert reserved_tokens(replace(HI, n=3), 0) == 4 + 3 * 40
    assert reserved_tokens(replace(HI, n=2, best_of=5), 0) == 4 + 5 * 40  # best_of's candidates all decode
    assert reserved_tokens(replace(HI, n=3), 30) == 4 + 3 * 26  # each choice within the context
    assert reserved_tokens(replace(HI, max_tokens=None, n=2), 1000) == 4 + 2 * 996
    cluster = Cluster(KeyLimits(tokens_per_day=100))
    assert isinstance(cluster.ask(T0, params=replace(HI, n=2)), TaskCreated)  # reserves 84
    assert refused(cluster.ask(T0, params=HI)).reason == (
        f"key {KEY.key_id} has 16 tokens of its daily quota of 100 left today (UTC) besides the 84 its open requests "
        "reserve, and this request reserves 44 (its prompt and max_tokens): try again when they end, or send a "
        "smaller max_tokens")
    assert f"this request reserves {4 + 3 * 40} tokens" in refused(cluster.ask(T0, params=replace(HI, n=3))).reason


def test_concurrent_requests_reserve_their_most_tokens_against_a_daily_quota_and_release_what_they_did_not_use():
    cluster = Cluster(KeyLimits(tokens_per_day=100))
    first, second = cluster.ask(T0, params=HI), cluster.ask(T0, params=HI)
    assert isinstance(first, TaskCreated) and isinstance(second, TaskCreated)
    third = refused(cluster.ask(T0, params=HI))
    assert third.reason == (f"key {KEY.key_id} has 12 tokens of its daily quota of 100 left today (UTC) besides the 88 "
                            "its open requests reserve, and this request reserves 44 (its prompt and max_tokens): try "
                            "again when they end, or send a smaller max_tokens")
    assert third.retry_after_s == 1.0
    cluster.finish(first, 2, 3)  # 5 tokens used: 39 of its 44 released
    assert isinstance(cluster.ask(T0, params=HI), TaskCreated)  # 5 used + 44 + 44 reserved = 93
    refused(cluster.ask(T0, params=HI))
    too_big = refused(cluster.ask(T0, params=replace(HI, max_tokens=96)))  # 100 > the 95 left even once all end
    assert too_big.reason == (f"key {KEY.key_id} has 95 tokens left today (UTC) of its daily quota of 100, and this "
                              "request reserves 100 (its prompt and max_tokens): send a smaller max_tokens, or try "
                              "again when its daily quota resets")
    assert too_big.retry_after_s == pytest.approx(calendar.timegm((2027, 1, 1, 0, 0, 0)) - T0)
    never = refused(cluster.ask(T0, params=replace(HI, max_tokens=97)))
    assert never.reason == (f"key {KEY.key_id}: this request reserves 101 tokens (its prompt and max_tokens), more than "
                            "its daily quota of 100: send a smaller max_tokens")


def test_a_per_minute_limit_counts_the_reservations_of_requests_started_in_its_minute():
    cluster = Cluster(KeyLimits(tokens_per_minute=100))
    assert [type(cluster.ask(T0, params=HI)) for _ in range(3)] == [TaskCreated, TaskCreated, CommandRejected]
    assert "of its limit of 100 left this minute besides the 88" in refused(cluster.ask(T0 + 49, params=HI)).reason
    assert isinstance(cluster.ask(T0 + 50, params=HI), TaskCreated)  # 23:59:00: the open two started last minute


# --- deleting a key ends its work, and its usage stays counted ---

def test_deleting_a_key_cancels_its_open_tasks_in_the_same_decision_and_still_counts_their_tokens():
    cluster = Cluster(KeyLimits())
    other = replace(KEY, key_id="key_fedcba9876543210")
    cluster.fold(KeySet(key=other))
    running, pending, waiting = cluster.ask(T0), cluster.ask(T0), cluster.ask(T0)
    bystander = cluster.ask(T0, key_id=other.key_id)
    assert all(isinstance(e, TaskCreated) for e in (running, pending, waiting, bystander))
    cluster.fold(TaskStarted(task_id="c1"))
    cluster.fold(TaskMigrated(task_id="c3", to_instance="", reason="its instance is gone", at=T0))  # waits for one
    events = decide(cluster.state, DeleteKey(command_id="delete", key_id=KEY.key_id), builtin_cards=CARDS, ids=iter([]))
    assert events == [TaskCancelRequested(task_id="c1", reason="the API key was deleted"),
                      TaskCancelRequested(task_id="c2", reason="the API key was deleted"),
                      TaskFinished(task_id="c3", status="cancelled", finish_reason="cancelled",
                                   error="the API key was deleted"),
                      KeyDeleted(command_id="delete", key_id=KEY.key_id)]
    for event in events:
        cluster.fold(event)
    tasks = cluster.state.tasks
    assert [(tasks[t].status, tasks[t].cancel_requested, tasks[t].cancel_reason) for t in ("c1", "c2", "c4")] == [
        ("running", True, "the API key was deleted"), ("pending", True, "the API key was deleted"), ("pending", False, "")]
    cluster.fold(TaskFinished(task_id="c1", status="cancelled", finish_reason="cancelled", prompt_tokens=7,
                              completion_tokens=9))  # its runner stopped, and says what it used
    assert cluster.state.usage[KEY.key_id] == {day_of(T0): {MODEL: UsageCounts(requests=3, prompt_tokens=7,
                                                                                 completion_tokens=9)}}
    assert KEY.key_id not in cluster.state.api_keys and KEY.key_id not in cluster.state.key_windows


def test_a_deleted_keys_task_its_runner_never_had_ends_with_the_reason():
    from exo.worker.plan import EndTask, LocalRunner, WorkerView, plan

    instance = Instance(instance_id="i", model_id=MODEL, shards=[ShardAssignment(runner_id="r", node_id="n")])
    task = replace(_task(1, KEY.key_id), cancel_requested=True, cancel_reason="the API key was deleted")
    view = WorkerView(node_id="n", state=State(instances={"i": instance}, tasks={task.task_id: task}),
                      runners={"r": LocalRunner(runner_id="r", instance_id="i", phase="ready")})
    assert [s for s in plan(view) if isinstance(s, EndTask)] == [
        EndTask(task_id=task.task_id, status="cancelled", reason="the API key was deleted")]


def test_a_groups_master_cancels_the_requests_of_a_key_the_shared_master_deleted():
    from exo.master.group import SETTLE_S, heal_group
    from exo.master.heal import HealLimits

    instance = Instance(instance_id="i", model_id=MODEL, shards=[ShardAssignment(runner_id="r", node_id="n")])
    tasks = {t.task_id: t for t in [_task(1, KEY.key_id), _task(2, "key_fedcba9876543210"), _task(3, "")]}
    group = State(group="alpha", instances={"i": instance}, tasks=tasks, api_keys={"key_fedcba9876543210": KEY})
    assert heal_group(group, now=T0 + 1 + SETTLE_S, limits=HealLimits()) == [
        TaskCancelRequested(task_id="t1", reason="the API key was deleted")]
    assert heal_group(group, now=T0 + 1, limits=HealLimits()) == []  # just admitted: the shared view may lag
