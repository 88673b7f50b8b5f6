"""Which instance of a model serves a request: the one whose runner holds the request's
conversation in its prompt cache, else the least busy. Pure: it reads State, and what the runners
last said their caches hold.

A runner's prompt cache holds the KV caches of the requests it served last (exo/runner/
prompt_cache.py), and State already says which instance served which recent request and with
what messages, by digest (`State.tasks`, the open ones and the last 1,000 finished): the request
that continues a conversation shares its leading messages with that conversation's earlier turns,
and goes where they went. What State cannot show is an eviction; each runner's report says which
finished tasks' entries it no longer holds (exo/core/cache_reports.py), and those attract nothing.
Without reports (a master that has heard none yet) it routes on State alone, as a new master folds it.

Only a conversation of the request's own cache scope counts (its key's, or the scope keys share:
exo/core/keys.py): the runner's cache holds nothing of another scope for it, and a detour towards
another key's conversation would tell that key's secrets by its timing.

Only a shared conversation counts, not a shared system prompt alone: every conversation of an
agent shares its system prompt, and routing on it would send them all to the first instance
that saw it. A system prompt is processed once per instance and cached there after that.
"""

from __future__ import annotations

from collections.abc import Mapping, Set
from typing import TYPE_CHECKING

from exo.core.catalogue import adapter_of
from exo.core.conversation import digest_conversation, prompt_starts_with
from exo.core.ids import InstanceId, ModelId, TaskId
from exo.core.requests import GenerationParams
from exo.core.state import State
from exo.core.types import ConversationDigest, Instance, RunnerInfo, Task

if TYPE_CHECKING:
    from exo.master.memo import ServingInstances

MIN_SHARED_PROMPT_CHARS = 32  # completions: a raw prompt that continues an earlier one by less is not worth a detour


NO_REPORTS: Mapping[InstanceId, Set[TaskId]] = {}


def choose_instance(state: State, candidates: list[Instance], params: GenerationParams,
                    open_tasks: Mapping[InstanceId, int], by_conversation: bool = True,
                    index: TaskIndex | None = None, dropped: Mapping[InstanceId, Set[TaskId]] = NO_REPORTS,
                    model_id: str = "") -> Instance:
    """The candidate that served the longest shared conversation still in its cache; ties (and none):
    the least busy. `dropped`: by instance, the finished tasks whose entries its runner reports gone.
    `model_id`: the request's; only its own tasks count (an instance of a base serving its adapters
    keeps each adapter's entries apart: exo/runner/adapter_rows.py). "": any model's.
    `index` (the master keeps one across requests) only saves time: the choice is the same without it."""
    return choose_sharing(state, candidates, params, open_tasks, by_conversation, index, dropped, model_id)[0]


def choose_sharing(state: State, candidates: list[Instance], params: GenerationParams,
                   open_tasks: Mapping[InstanceId, int], by_conversation: bool = True,
                   index: TaskIndex | None = None, dropped: Mapping[InstanceId, Set[TaskId]] = NO_REPORTS,
                   model_id: str = "") -> tuple[Instance, int]:
    """choose_instance's choice, and how much of the conversation its cache holds (0: none known)."""
    shared = {i.instance_id: 0 for i in candidates}
    if by_conversation and (len(candidates) > 1 or candidates[0].role == "decode"):  # a decode instance: may skip a prefill
        later = digest_conversation(params)
        for task in index.alike(state, later) if index is not None else _all_alike(state, later, params):
            if task.instance_id in shared and task.params.cache_scope == params.cache_scope \
                    and (not model_id or task.model_id == model_id) and not _dropped(task, dropped):
                here = shared_conversation(task.conversation, later, params.prompt)
                shared[task.instance_id] = max(shared[task.instance_id], here)
    chosen = min(candidates, key=lambda i: (-shared[i.instance_id], open_tasks[i.instance_id]))
    return chosen, shared[chosen.instance_id]


def base_serving(state: State, model_id: ModelId,
                 serving: ServingInstances) -> tuple[list[Instance], dict[InstanceId, RunnerInfo]]:
    """EXO_ADAPTERS_SHARE_BASE: "<base>:<adapter>" without an instance of its own is served by its
    base's instances, single-node or multi-node (every rank selects the adapter for its rows:
    exo/runner/adapter_rows.py), the adapter applied to its rows. DoRA, which rescales whole
    weights, is not: it gets an instance of its own."""
    adapter = adapter_of(state, model_id)
    if adapter is None or adapter.fine_tune_type != "lora":
        return [], {}
    return serving.of(state, adapter.base_model)


def _dropped(task: Task, dropped: Mapping[InstanceId, Set[TaskId]]) -> bool:
    """An open task's entry is yet to be stored; a finished one's may be gone, if its runner says so."""
    gone = dropped.get(task.instance_id)
    return gone is not None and task.status not in ("pending", "running") and task.task_id in gone


def _all_alike(state: State, later: ConversationDigest, params: GenerationParams) -> list[Task]:
    """Without an index: every kept task, less those whose first message differs (they share nothing)."""
    opening = later.messages[0] if later.messages and params.prompt is None else None
    return [task for task in state.tasks.values() if opening is None or task.conversation.prompt_chars >= 0
            or (task.conversation.messages and task.conversation.messages[0] == opening)]


ChatKey = tuple[str, tuple[str, ...]]


def chat_key(conversation: ConversationDigest) -> ChatKey | None:
    """What two chats must have in common for one's cache to serve the other at all: their tools
    and their messages up to the first one that is no system prompt (message digests include the
    role). None: a raw prompt, or a chat of system prompts only (which shares nothing that counts)."""
    if conversation.prompt_chars >= 0:
        return None
    first = next((n for n, role in enumerate(conversation.roles) if role != "system"), None)
    if first is None or first >= len(conversation.messages):
        return None
    return conversation.tools, tuple(conversation.messages[:first + 1])


class TaskIndex:
    """State's tasks by `chat_key`, so routing compares a request with the few tasks that can share
    its conversation instead of every task State keeps (1,000 finished and the open ones). A cache
    over State, not a second truth: each call first brings it up to the State it is given (one
    symmetric difference of task ids, in C: tasks new to it are indexed, tasks gone are forgotten,
    so an id that comes back is indexed afresh), and reads every task back from that State, so a
    stale entry is skipped. The master starts a new one each term. Rebuilt when its entries
    outnumber twice the tasks kept."""

    def __init__(self) -> None:
        self._forget_all()

    def _forget_all(self) -> None:
        self._seen: set[TaskId] = set()
        self._chats: dict[ChatKey, list[TaskId]] = {}
        self._prompts: list[TaskId] = []
        self._entries = 0

    def alike(self, state: State, conversation: ConversationDigest) -> list[Task]:
        """The tasks of `state` whose cache may hold part of `conversation`: for a chat, those with
        its chat key; for a raw prompt, every raw prompt's."""
        self._catch_up(state)
        if conversation.prompt_chars >= 0:
            ids: list[TaskId] = self._prompts
        else:
            key = chat_key(conversation)
            ids = self._chats.get(key, []) if key is not None else []
        return [task for task_id in ids if (task := state.tasks.get(task_id)) is not None]

    def _catch_up(self, state: State) -> None:
        if self._entries > 2 * len(state.tasks) + 64:
            self._forget_all()  # start over from the tasks kept now
        for task_id in self._seen.symmetric_difference(state.tasks.keys()):
            task = state.tasks.get(task_id)
            if task is None:
                self._seen.discard(task_id)  # evicted (or not in this State yet): indexed afresh if it comes
                continue
            self._seen.add(task_id)
            self._entries += 1
            if task.conversation.prompt_chars >= 0:
                self._prompts.append(task_id)
            elif (key := chat_key(task.conversation)) is not None:
                self._chats.setdefault(key, []).append(task_id)


def shared_conversation(earlier: ConversationDigest, later: ConversationDigest, later_prompt: str | None) -> int:
    """How much of `later`'s prompt an earlier request's cache can hold, in characters: its leading
    messages equal to `earlier`'s, counted once they include more than system prompts."""
    if earlier.prompt_chars >= 0 or later_prompt is not None:
        return _continued_prompt(earlier, later_prompt)
    if earlier.tools != later.tools:  # tool definitions are rendered ahead of the messages
        return 0
    shared, past_system = 0, False
    for mine, theirs, chars, role in zip(earlier.messages, later.messages, later.chars, later.roles, strict=False):
        if mine != theirs:
            break
        shared += chars
        past_system = past_system or role != "system"
    return shared if past_system else 0


def _continued_prompt(earlier: ConversationDigest, later: str | None) -> int:
    if later is None or earlier.prompt_chars < MIN_SHARED_PROMPT_CHARS or not prompt_starts_with(later, earlier):
        return 0
    return earlier.prompt_chars
