"""The reducer's handlers for what the cluster offers and to whom: custom model cards, LoRA
adapters, API keys, and each key's usage and limit windows (counted as tasks are created and
finish). exo/core/apply.py dispatches to them; the same rules hold (decide, then change)."""

from __future__ import annotations

from msgspec.structs import replace

from exo.core.draft import Draft
from exo.core.events import (
    AdapterAdded,
    AdapterDeleted,
    AdapterDeleting,
    CustomCardAdded,
    CustomCardDeleted,
    KeyDeleted,
    KeySet,
    TaskFinished,
)
from exo.core.keys import KeyWindow, window_after, window_with_tokens
from exo.core.skip import Skip
from exo.core.types import Task
from exo.core.usage import UsageCounts, counted


def on_card_added(draft: Draft, event: CustomCardAdded, seq: int) -> None:
    problem = event.card.problem()  # e.g. a stray publisher's: a bad card in State would stop every worker
    if problem:
        raise Skip(f"custom card: {problem}")
    draft.own("custom_model_cards")[event.card.model_id] = event.card


def on_card_deleted(draft: Draft, event: CustomCardDeleted, seq: int) -> None:
    if event.model_id not in draft.custom_model_cards:
        raise Skip(f"unknown custom card {event.model_id}")
    del draft.own("custom_model_cards")[event.model_id]


def on_adapter_added(draft: Draft, event: AdapterAdded, seq: int) -> None:
    if problem := event.adapter.problem():  # a stray publisher's: workers write its config to disk
        raise Skip(f"adapter: {problem}")
    draft.own("adapters")[event.adapter.name] = event.adapter


def on_adapter_deleted(draft: Draft, event: AdapterDeleted, seq: int) -> None:
    if event.name not in draft.adapters:
        raise Skip(f"unknown adapter {event.name}")
    del draft.own("adapters")[event.name]


def on_adapter_deleting(draft: Draft, event: AdapterDeleting, seq: int) -> None:
    adapter = draft.adapters.get(event.name)
    if adapter is None:
        raise Skip(f"unknown adapter {event.name}")
    if not adapter.deleting:  # marked already: a second DELETE waits for the same end
        draft.own("adapters")[event.name] = replace(adapter, deleting=True)


def on_key_set(draft: Draft, event: KeySet, seq: int) -> None:
    if problem := event.key.problem():
        raise Skip(f"api key: {problem}")
    draft.own("api_keys")[event.key.key_id] = event.key


def on_key_deleted(draft: Draft, event: KeyDeleted, seq: int) -> None:
    if event.key_id not in draft.api_keys:
        raise Skip(f"unknown api key {event.key_id}")
    del draft.own("api_keys")[event.key_id]
    draft.own("key_windows").pop(event.key_id, None)  # its usage stays: GET /usage still reports it


def count_request(draft: Draft, task: Task) -> None:
    """A task of a key was created: one request, and one more in its per-minute window."""
    key = draft.api_keys.get(task.key_id) if task.key_id else None
    if key is None:
        return
    windows = draft.own("key_windows")
    windows[key.key_id] = window_after(windows.get(key.key_id, KeyWindow()), key, task.created_at)
    _count(draft, task, UsageCounts(requests=1))


def count_tokens(draft: Draft, task: Task, event: TaskFinished) -> None:
    if not task.key_id:
        return
    # A transcription's audio counts once it is transcribed (as the API's /metrics counter does), by
    # the length the API measured and put in the task: the same on every replay. Speech counts what
    # its runner generated, however the task ended (a cancelled one was heard up to there).
    audio = task.params.transcribe
    heard = audio.seconds if audio is not None and event.status == "completed" else 0.0
    used = UsageCounts(prompt_tokens=event.prompt_tokens, completion_tokens=event.completion_tokens,
                       cached_tokens=event.cached_tokens, audio_seconds=heard + event.audio_seconds)
    if task.key_id in draft.api_keys:  # a deleted key's window went with it; its usage is counted all the same
        windows = draft.own("key_windows")
        windows[task.key_id] = window_with_tokens(windows.get(task.key_id, KeyWindow()), task.created_at, used.tokens)
    _count(draft, task, used)


def _count(draft: Draft, task: Task, add: UsageCounts) -> None:
    draft.usage = counted(draft.usage, task.key_id, task.created_at, task.model_id, add)
    totals = draft.own("usage_totals")
    models = dict(totals.get(task.key_id, {}))
    models[task.model_id] = models.get(task.model_id, UsageCounts()).plus(add)
    totals[task.key_id] = models
