"""The ranks other than 0 of a multi-node instance: run what rank 0 tells them, step by step.

Rank 0's messages (distributed.py) come in the order its model thread ran them: a single-path
generation, or one step of its batch. A follower runs the same model calls with the same
inputs, so every collective inside them meets its peer; the text is rank 0's to publish and is
dropped here. A row's LoRA adapter, named by rank 0, is made resident and selected here too
(adapter_rows.py): fetched by its hash with `fetch`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from contextlib import nullcontext

from mlx_lm.generate import BatchGenerator

from exo.runner.adapter_rows import Fetch, RowSelectingModel
from exo.runner.batch import resident_adapters
from exo.runner.batch_steps import insert, keep_caches, new_generator
from exo.runner.distributed import AgreedSamplers, BatchStep, Lockstep, StepAnnouncement
from exo.runner.engine_api import ModelEngine

log = logging.getLogger(__name__)


def _cannot_fetch(digest: str) -> bytes:
    raise RuntimeError(f"rank 0 named adapter weights {digest[:12]} and this rank has no way to fetch them")


def follow(engine: ModelEngine, fetch: Fetch = _cannot_fetch) -> None:
    """Until rank 0 says it is leaving (or the group breaks: then this raises)."""
    lockstep = engine.lockstep
    assert lockstep is not None and not lockstep.leads
    batch = BatchFollower(engine, lockstep, fetch)
    adapters = resident_adapters(engine)
    while (message := lockstep.next_message()) is not None:
        if isinstance(message, StepAnnouncement):
            with adapters.alone_fetched(engine.model, message.adapter, message.task_id, fetch) if adapters \
                    else nullcontext():
                engine.generate(message.params, message.defaults, lambda _: None, lambda: False, message.task_id,
                                message)
        elif isinstance(message, BatchStep):
            batch.step(message)


class BatchFollower:
    """Rank 0's batch, replayed: the same BatchGenerator, the same inserts and removals in the
    same order, so its request ids, its grouping and its collectives match rank 0's. Its prompt
    cache stores and reuses the same entries as rank 0's, and drops what rank 0 dropped."""

    def __init__(self, engine: ModelEngine, lockstep: Lockstep, fetch: Fetch) -> None:
        self._model, self._tokenizer, self._cache = engine.model, engine.tokenizer, engine.prompt_cache
        self._samplers = AgreedSamplers(lockstep)
        self._generator: BatchGenerator | None = None
        self._scopes: dict[int, str] = {}  # uid -> cache scope, as rank 0's Batcher keeps them
        self._adapters, self._fetch = resident_adapters(engine), fetch  # rows hold their adapters by uid

    def step(self, step: BatchStep) -> None:
        if step.new_batch:
            self._release(list(self._scopes))
            model = self._model if self._adapters is None else RowSelectingModel(self._model, self._adapters, _same)
            self._generator = new_generator(model, self._tokenizer, step.new_batch)
            self._samplers.clear()
            self._scopes = {}
        if self._generator is None:
            raise RuntimeError("out of step with rank 0: told to step a batch this rank does not have")
        keep_caches(self._cache, self._generator, [], step.leaves, self._scopes)
        self._release(step.leaves)
        self._cache.trim(entries=step.cache_entries)
        for join in step.joins:
            reuse = self._cache.take(join.tokens, scope=join.cache_scope, expect=join.cached)
            uid = insert(self._generator, join, self._samplers.get(join.sampling), reuse)
            self._scopes[uid] = join.cache_scope
            if join.adapter is not None and self._adapters is not None:
                self._adapters.hold_ref(self._model, join.adapter, uid, self._fetch)
        try:
            _, responses = self._generator.next()
            finished = [r for r in responses if r.finish_reason]
            keep_caches(self._cache, self._generator, finished, [], self._scopes)
            self._release(r.uid for r in finished)
        except Exception:
            # Rank 0 ran the same step; if it failed there too, its next step starts a new batch.
            log.exception("a batch step failed")
            self._generator = None

    def _release(self, uids: Iterable[int]) -> None:
        if self._adapters is not None:
            for uid in uids:
                self._adapters.release(uid)


def _same(uid: int) -> int:
    return uid
