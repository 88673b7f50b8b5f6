"""Which instance of a model serves a request: the one whose runner holds the request's
conversation in its prompt cache, else the least busy. Pure: it reads State only.

A runner's prompt cache holds the KV caches of the requests it served last (exo/runner/
prompt_cache.py), and State already says which instance served which recent request and with
what messages (`State.tasks`, the open ones and the last 1,000 finished). So the master needs no
summary of the caches from the runners: the request that continues a conversation shares its
leading messages with that conversation's earlier turns, and goes where they went. A new master
folds the same State and routes the same way.

Only a shared conversation counts, not a shared system prompt alone: every conversation of an
agent shares its system prompt, and routing on it would send them all to the first instance
that saw it. A system prompt is processed once per instance and cached there after that.
"""

from __future__ import annotations

from collections.abc import Mapping

from exo.core.state import State
from exo.core.types import GenerationParams, Instance

MIN_SHARED_PROMPT_CHARS = 32  # completions: a raw prompt that continues an earlier one by less is not worth a detour


def choose_instance(state: State, candidates: list[Instance], params: GenerationParams,
                    open_tasks: Mapping[str, int], by_conversation: bool = True) -> Instance:
    """The candidate that served the longest shared conversation; ties (and none): the least busy."""
    shared = {i.instance_id: 0 for i in candidates}
    if by_conversation and len(candidates) > 1:
        for task in state.tasks.values():
            if task.instance_id in shared:
                shared[task.instance_id] = max(shared[task.instance_id], shared_conversation(task.params, params))
    return min(candidates, key=lambda i: (-shared[i.instance_id], open_tasks[i.instance_id]))


def shared_conversation(earlier: GenerationParams, later: GenerationParams) -> int:
    """How much of `later`'s prompt an earlier request's cache can hold, in characters: its leading
    messages equal to `earlier`'s, counted once they include more than system prompts."""
    if earlier.prompt is not None or later.prompt is not None:
        return _continued_prompt(earlier.prompt, later.prompt)
    if earlier.tools != later.tools:  # tool definitions are rendered ahead of the messages
        return 0
    shared, past_system = 0, False
    for mine, theirs in zip(earlier.messages, later.messages):
        if mine != theirs:
            break
        shared += len(mine.content) + 1
        past_system = past_system or mine.role != "system"
    return shared if past_system else 0


def _continued_prompt(earlier: str | None, later: str | None) -> int:
    if earlier is None or later is None or len(earlier) < MIN_SHARED_PROMPT_CHARS or not later.startswith(earlier):
        return 0
    return len(earlier)
