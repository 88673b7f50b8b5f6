"""Which instance of a model serves a request: the one whose runner holds the request's
conversation in its prompt cache, else the least busy. Pure: it reads State only.

A runner's prompt cache holds the KV caches of the requests it served last (exo/runner/
prompt_cache.py), and State already says which instance served which recent request and with
what messages, by digest (`State.tasks`, the open ones and the last 1,000 finished). So the master needs no
summary of the caches from the runners: the request that continues a conversation shares its
leading messages with that conversation's earlier turns, and goes where they went. A new master
folds the same State and routes the same way.

Only a shared conversation counts, not a shared system prompt alone: every conversation of an
agent shares its system prompt, and routing on it would send them all to the first instance
that saw it. A system prompt is processed once per instance and cached there after that.
"""

from __future__ import annotations

from collections.abc import Mapping

from exo.core.conversation import digest_conversation, prompt_starts_with
from exo.core.ids import InstanceId
from exo.core.state import State
from exo.core.types import ConversationDigest, GenerationParams, Instance

MIN_SHARED_PROMPT_CHARS = 32  # completions: a raw prompt that continues an earlier one by less is not worth a detour


def choose_instance(state: State, candidates: list[Instance], params: GenerationParams,
                    open_tasks: Mapping[InstanceId, int], by_conversation: bool = True) -> Instance:
    """The candidate that served the longest shared conversation; ties (and none): the least busy."""
    shared = {i.instance_id: 0 for i in candidates}
    if by_conversation and len(candidates) > 1:
        later = digest_conversation(params)
        opening = later.messages[0] if later.messages and params.prompt is None else None
        # Different first messages share nothing: those tasks are passed over without the full
        # comparison (the common case). One comprehension, not a loop: this runs over every task
        # State keeps (1,000 finished and the open ones) for every request the master admits.
        worth_comparing = [task for task in state.tasks.values() if task.instance_id in shared and (
            opening is None or task.conversation.prompt_chars >= 0
            or (task.conversation.messages and task.conversation.messages[0] == opening))]
        for task in worth_comparing:
            here = shared_conversation(task.conversation, later, params.prompt)
            shared[task.instance_id] = max(shared[task.instance_id], here)
    return min(candidates, key=lambda i: (-shared[i.instance_id], open_tasks[i.instance_id]))


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
