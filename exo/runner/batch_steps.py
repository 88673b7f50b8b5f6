"""What is done to mlx-lm's `BatchGenerator`, the same way on every rank of an instance: make it,
insert a request from its cached prefix, keep the KV caches of the requests that end.

Rank 0's `Batcher` (batch.py) decides and does these steps; the other ranks replay them in the
same order (follower.py), so both take them from here.
"""

from __future__ import annotations

from typing import Any

from mlx_lm.generate import BatchGenerator
from mlx_lm.sample_utils import make_sampler

from exo.core.ids import TaskId
from exo.runner import prefill
from exo.runner.distributed import BatchJoin, Sampler
from exo.runner.engine import WARM_UP_TEMPERATURE, WARM_UP_TOP_P, LogitsProcessor, logits_processors_of
from exo.runner.prompt_cache import PromptCache, Reuse

# Prompts processed together at most, as mlx_lm.server's --prompt-concurrency: a batch step prefills
# a chunk (prefill.PREFILL_STEP tokens) of each.
PREFILL_BATCH = 8


def new_generator(model: Any, tokenizer: Any, limit: int) -> BatchGenerator:
    return BatchGenerator(
        model, stop_tokens=[[t] for t in tokenizer.eos_token_ids],
        completion_batch_size=limit, prefill_batch_size=min(limit, PREFILL_BATCH), prefill_step_size=prefill.PREFILL_STEP,
    )


def insert(generator: BatchGenerator, join: BatchJoin, sampler: Sampler, reuse: Reuse,
           constraint: list[LogitsProcessor] | None = None) -> int:
    """Into the batch, starting from the cached prefix (`reuse`): only the rest is processed.
    `constraint`: the request's own response_format processor (rank 0 only: it samples)."""
    processors = [*logits_processors_of(join), *(constraint or [])]
    uids: list[int] = generator.insert(
        [reuse.rest], max_tokens=[join.max_tokens], caches=[reuse.cache], all_tokens=[join.tokens[:reuse.cached]],
        samplers=[sampler], logits_processors=[processors],
    )
    (uid,) = uids
    return uid


def keep_caches(cache: PromptCache, generator: BatchGenerator, finished: list[Any], leaving: list[int],
                scopes: dict[int, str], owners: dict[int, TaskId] | None = None) -> None:
    """Store the KV caches of requests that just ended (mlx-lm's finished ones, then those we remove)
    in their cache scopes (`scopes`: uid -> scope, emptied of them here) and take the leaving ones
    out of the batch. Every rank does this in the same order. `owners` (rank 0): uid -> its task,
    emptied alike, for what the cache reports it holds."""
    owners = {} if owners is None else owners
    for response in finished:
        owner = owners.pop(response.uid, TaskId(""))
        if (scope := scopes.pop(response.uid, None)) is not None:  # none: not kept, rather than in another scope
            cache.keep(response.all_tokens, response.prompt_cache, scope=scope, owner=owner)
    if leaving:
        scoped = {uid: (scopes.pop(uid, None), owners.pop(uid, TaskId(""))) for uid in leaving}
        for uid, (kv, tokens) in generator.remove(leaving, return_prompt_caches=cache.enabled).items():
            if (scope := scoped[uid][0]) is not None:
                cache.keep(tokens, kv, scope=scope, owner=scoped[uid][1])


def warm_up_batch(model: Any, prompt: list[int]) -> None:
    """Two sampled rows of `prompt` (one a token shorter) in a throwaway batch, to their fixed end."""
    generator = BatchGenerator(model, completion_batch_size=2, prefill_batch_size=2, prefill_step_size=prefill.PREFILL_STEP)
    sampler = make_sampler(temp=WARM_UP_TEMPERATURE, top_p=WARM_UP_TOP_P)
    generator.insert([prompt, prompt[1:]], max_tokens=[2, 2], samplers=[sampler, sampler])
    ended = 0
    while ended < 2:
        _, responses = generator.next()
        ended += sum(1 for response in responses if response.finish_reason)
    generator.close()
