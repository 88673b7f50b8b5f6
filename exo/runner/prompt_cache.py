"""The runner's prompt cache: KV caches of recent requests, reused by their longest token prefix.

A chat resends the whole conversation every turn; with the cache a turn only processes what is
new since the last one. The store is mlx-lm's own `LRUPromptCache` (what `mlx_lm.server` runs),
so which entry serves a prompt, and how a longer entry is trimmed down to the shared prefix, are
mlx-lm's decisions. This module adds what a runner needs around it: a byte budget, counters, at
least one token left to process (a model call must produce the first token's logits), entries
partitioned by cache scope (a request reuses only entries of its own scope: its API key's, or the
scope keys share; docs/prompt-cache.md), on a multi-node instance the same entries on every rank
(see `take(expect=...)` and `trim`), and what it holds, by the task that stored each entry, for the
master's routing (`contents`).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import LRUPromptCache, can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache

from exo.core.cache_reports import EMPTY, MAX_HELD, CacheContents, HeldEntry
from exo.core.ids import TaskId
from exo.core.types import PromptCacheStats
from exo.settings.services import RunnerSettings

log = logging.getLogger(__name__)

DEFAULT_ENTRIES = RunnerSettings().prompt_cache_entries  # mlx_lm.server's --prompt-cache-size
DEFAULT_SHARE_OF_FREE_MEMORY = 0.25
FOLLOWER_BUDGET = 1 << 62  # ranks other than 0 keep what rank 0 keeps, whatever their own setting
DROPPED_KEPT = 1024  # tasks whose entries went, latest last: at least the finished tasks State keeps (1,000)
REPORT_BYTES = 48 * 1024  # of task ids a report carries at most: the worker reads a runner's lines up to 64 KiB


class OutOfStep(RuntimeError):
    """A rank's cache would reuse another prefix than rank 0's: the instance must re-form."""


@dataclass
class Reuse:
    """What a request starts from: a KV cache holding `cached` tokens of its prompt, and the rest."""

    cache: list[Any] | None  # None: stream_generate makes a fresh one (speculative decoding: for both models)
    rest: list[int]
    cached: int


def budget_bytes(configured: int | None, free_memory: int) -> int:
    """EXO_PROMPT_CACHE_BYTES (0 turns the cache off), else a quarter of the memory free now."""
    return configured if configured is not None else int(free_memory * DEFAULT_SHARE_OF_FREE_MEMORY)


class PromptCache:
    """Runs on the model thread only."""

    def __init__(self, model: Any, max_bytes: int, max_entries: int = DEFAULT_ENTRIES) -> None:
        self._model = model
        self.max_bytes = max_bytes
        self.max_entries = max_entries
        # Limits are applied by `trim` (it counts evictions and knows the bytes of live batches).
        self._lru = LRUPromptCache(max_size=1 << 62, max_bytes=1 << 62)
        self._owners = EntryOwners()
        self._hits = self._misses = self._reused = self._evictions = 0

    @property
    def entries(self) -> int:
        return len(self._lru)

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    @property
    def contents(self) -> CacheContents:
        """What it holds now, by the task that stored each entry (a snapshot, readable from any thread)."""
        return self._owners.contents

    def take(self, tokens: list[int], *, scope: str, expect: int | None = None) -> Reuse:
        """A cache for `tokens`: a copy of the best entry of `scope` (trimmed to the shared prefix) or a new one.
        `expect`: rank 0's `cached` for this request; another answer here means the ranks diverged."""
        reuse = self._lookup(tokens, scope)
        if expect is not None and reuse.cached != expect:
            raise OutOfStep(f"prompt cache out of step with rank 0: {reuse.cached} cached tokens here, {expect} there")
        if reuse.cached:
            self._hits, self._reused = self._hits + 1, self._reused + reuse.cached
        else:
            self._misses += 1
        return reuse

    def _lookup(self, tokens: list[int], scope: str) -> Reuse:
        if not self.enabled or not tokens:
            return self._fresh(tokens)
        # mlx-lm's first key (a model's, in its server) keeps a trie of its own: scopes share no entry.
        cache, rest = self._lru.fetch_nearest_cache(scope, tokens)
        if cache is None:
            return self._fresh(tokens)
        if not rest:  # the whole prompt is cached: process its last token again for the first logits
            if not can_trim_prompt_cache(cache):
                return self._fresh(tokens)
            trim_prompt_cache(cache, 1)
            rest = tokens[-1:]
        return Reuse(cache=cache, rest=list(rest), cached=len(tokens) - len(rest))

    def _fresh(self, tokens: list[int]) -> Reuse:
        return Reuse(cache=make_prompt_cache(self._model), rest=list(tokens), cached=0)

    def keep(self, tokens: list[int], cache: list[Any], *, scope: str, owner: TaskId = TaskId("")) -> None:
        """Remember `cache`, which holds exactly `tokens` (prompt and generated so far), for `scope`'s requests.
        `owner`: the task whose end stored it ("" : none to report, as on ranks other than 0)."""
        held = tokens_held(cache)
        if not self.enabled or not tokens or held is None or held < len(tokens) or (
                held > len(tokens) and not can_trim_prompt_cache(cache)):
            self._owners.not_stored(owner)
            return
        if held > len(tokens):
            trim_prompt_cache(cache, held - len(tokens))
        mx.eval([layer.state for layer in cache])  # nothing lazy left to compute when another request reuses it
        self._lru.insert_cache(scope, list(tokens), cache)
        self._owners.stored(scope, tokens, owner, drops_prefixes=can_trim_prompt_cache(cache))
        self._owners.check(len(self._lru))

    def trim(self, active_bytes: int = 0, entries: int | None = None) -> None:
        """Evict the least recently stored entries until the cache fits.
        `active_bytes`: KV memory of requests still running, which counts against the budget.
        `entries`: rank 0's count (other ranks: drop the same entries, whatever their bytes)."""
        before = len(self._lru)
        if entries is not None:
            self._lru.trim_to(n_sequences=entries)
        else:
            self._lru.trim_to(n_sequences=self.max_entries, n_bytes=self.max_bytes - active_bytes)
        self._evictions += before - len(self._lru)
        self._owners.trimmed(len(self._lru))

    def stats(self) -> PromptCacheStats:
        return PromptCacheStats(hits=self._hits, misses=self._misses, tokens_reused=self._reused,
                                bytes=self._lru.nbytes, entries=len(self._lru), evictions=self._evictions)


EntryKey = tuple[str, tuple[int, ...]]  # (scope, tokens): how mlx-lm's LRUPromptCache knows an entry


class EntryOwners:
    """Which task stored each entry of the `LRUPromptCache` beside it, in the same order. It follows
    mlx-lm's rules: `insert_cache` replaces an equal key and drops the key's cached prefixes where
    the cache can be trimmed (the longer entry serves them), and `trim_to` drops the least recently
    stored first. `contents` is a new snapshot after each change, never changed in place: the
    runner's event loop reads it while the model thread works."""

    def __init__(self) -> None:
        self._owners: OrderedDict[EntryKey, TaskId] = OrderedDict()
        self._entries_of: dict[TaskId, int] = {}
        self._dropped: OrderedDict[TaskId, None] = OrderedDict()
        self._in_step = True
        self.contents = EMPTY

    def stored(self, scope: str, tokens: list[int], owner: TaskId, *, drops_prefixes: bool) -> None:
        key = (scope, tuple(tokens))
        if key in self._owners:
            self._remove(key)
        if drops_prefixes:
            for shorter in [k for k in self._owners if k[0] == scope and len(k[1]) < len(key[1])
                            and key[1][:len(k[1])] == k[1]]:
                self._remove(shorter)
        self._owners[key] = owner
        self._entries_of[owner] = self._entries_of.get(owner, 0) + 1
        self._dropped.pop(owner, None)
        self._snapshot()

    def not_stored(self, owner: TaskId) -> None:
        if owner not in self._entries_of:
            self._drop(owner)
            self._snapshot()

    def trimmed(self, entries: int) -> None:
        if len(self._owners) > entries:
            while len(self._owners) > entries:
                self._remove(next(iter(self._owners)))
            self._snapshot()

    def check(self, entries: int) -> None:
        """A newer mlx-lm whose rules differ: report nothing rather than the wrong entries (the
        master then routes as it would without reports)."""
        if self._in_step and len(self._owners) != entries:
            log.warning("prompt cache: %d entries here, %d in mlx-lm's LRUPromptCache; its contents are no "
                        "longer reported", len(self._owners), entries)
            self._in_step, self.contents = False, EMPTY

    def _remove(self, key: EntryKey) -> None:
        owner = self._owners.pop(key)
        self._entries_of[owner] -= 1
        if not self._entries_of[owner]:
            del self._entries_of[owner]
            self._drop(owner)

    def _drop(self, owner: TaskId) -> None:
        if owner:
            self._dropped.pop(owner, None)
            self._dropped[owner] = None
            while len(self._dropped) > DROPPED_KEPT:
                self._dropped.popitem(last=False)

    def _snapshot(self) -> None:
        if not self._in_step:
            return
        longest: dict[TaskId, int] = {}  # a request of several choices stores an entry per choice
        for (_, key_tokens), owner in self._owners.items():
            if owner:
                longest[owner] = max(longest.pop(owner, 0), len(key_tokens))  # latest last
        room = REPORT_BYTES  # the latest first, entries before tasks gone, while the report stays a line the worker reads
        held: list[HeldEntry] = []
        for owner, tokens in reversed(longest.items()):
            if (room := room - len(owner) - 32) < 0 or len(held) == MAX_HELD:
                break
            held.append(HeldEntry(task_id=owner, tokens=tokens))
        dropped: list[TaskId] = []
        for owner in reversed(self._dropped):
            if (room := room - len(owner) - 4) < 0:
                break
            dropped.append(owner)
        self.contents = CacheContents(held=held[::-1], dropped=dropped[::-1])


def tokens_held(cache: list[Any]) -> int | None:
    """How many tokens a model's cache holds, where its layers say (None: they do not)."""
    offsets = {getattr(layer, "offset", None) for layer in cache}
    if len(offsets) != 1 or None in offsets:
        return None
    (offset,) = offsets
    return int(offset or 0)
