"""Continuous batching: concurrent requests to one instance decode together, one step for all.

The batch is mlx-lm's own `BatchGenerator` (what `mlx_lm.server` runs). One drive loop on the
model thread inserts the runner's jobs, steps the batch and feeds each request's tokens,
detokenized as `stream_generate` does, through the single path's `Decoding` (engine.py). A
request leaves at EOS or max_tokens, a stop string, or when cancelled (checked every step);
others join as they come, up to `EXO_MAX_BATCH`. A seeded request samples with a key of its own
(engine.seeded_sampler); on a multi-node instance it takes the single path, as images do.

In a multi-node instance the batch runs on every rank in lockstep: before each step rank 0
tells the others who joins (with its LoRA adapter, if any) and who leaves (`BatchStep`), and
every sampled token is rank 0's (distributed.py); the other ranks replay the steps (follower.py).
"""

from __future__ import annotations

import asyncio
import copy
import functools
import logging
import threading
from collections.abc import Callable
from concurrent.futures import Executor, ThreadPoolExecutor
from typing import Any

from mlx_lm.generate import BatchGenerator
from mlx_lm.sample_utils import make_sampler

from exo.core.ids import TaskId
from exo.core.requests import GenerationParams, rows_of
from exo.core.types import SamplingDefaults
from exo.runner.adapter_rows import ResidentAdapters, RowSelectingModel
from exo.runner.batch_steps import insert, keep_caches, new_generator, warm_up_batch
from exo.runner.choices import Choices, first_of_choices, ranks_candidates, row_seed, sibling
from exo.runner.decoding import Decoding, GenerationResult, OnOutput, Output, RequestRefused
from exo.runner.distributed import AdapterRef, AgreedSamplers, BatchJoin, BatchStep, Lockstep, Sampler, Sampling
from exo.runner.engine import check_logit_bias, sampling_of, seeded_sampler, vocabulary_size
from exo.runner.engine_api import ModelEngine
from exo.runner.prompt_cache import Reuse

log = logging.getLogger(__name__)

Outcome = GenerationResult | BaseException


def batchable(params: GenerationParams, image_paths: dict[str, str], multi_node: bool) -> bool:
    # Several choices fan out from one row on this rank only (choices.py): the other ranks could not follow.
    return not image_paths and (not multi_node or (params.seed is None and rows_of(params) == 1))


@functools.lru_cache(maxsize=64)
def _shared_sampler(temperature: float, top_p: float, top_k: int, min_p: float) -> Sampler:
    # One sampler object per setting: a batch whose requests share it samples in one call.
    sampler: Sampler = make_sampler(temp=temperature, top_p=top_p, top_k=top_k, min_p=min_p)
    return sampler


class BatchFailed(RuntimeError):
    """The batch itself failed (not one request in it): every request in it ends with this."""


class Job:
    """One request in the batch: its settings, and where its output and its end go."""

    def __init__(self, params: GenerationParams, defaults: SamplingDefaults, on_output: OnOutput,
                 is_cancelled: Callable[[], bool], task_id: TaskId, on_done: Callable[[Outcome], None]) -> None:
        self.params, self.defaults, self.task_id = params, defaults, task_id
        self.on_output, self.is_cancelled, self.on_done = on_output, is_cancelled, on_done
        self.decoding: Decoding | None = None
        self.detokenizer: Any = None
        self.prompt_tokens = self.generated = 0
        self.tokens: list[int] = []  # the prompt's (prepare)
        self.max_tokens = 0  # what the context leaves it (prepare)
        self.on_start: Callable[[], None] | None = None  # as it joins the batch (Batcher.run)
        self.choice = 0  # which of its request's choices this row decodes
        self.choices: Choices | None = None  # its request's rows, when it has several (choices.py)
        self.logprob = 0.0  # the sum of its tokens' logprobs, when best_of ranks the rows
        self.adapter_path = ""  # a LoRA adapter for its rows alone (adapter_rows.py)

    def _emit(self, out: Output) -> None:
        out.choice = self.choice
        self.on_output(out)

    def prepare(self, engine: ModelEngine) -> None:
        """The prompt's tokens and token budget, off the model thread (tokenizing megabytes takes
        seconds); PromptTooLong, found by its length or its tokens, before it ever reaches the batch."""
        check_logit_bias(self.params.logit_bias, vocabulary_size(engine.model))
        self.tokens = engine.encode(engine.prompt_for(self.params))
        if not self.tokens:  # mlx-lm's own check, made before a sampler is taken (see AgreedSamplers)
            raise ValueError("the prompt is empty")
        self.max_tokens = engine.max_tokens_for(self.params, len(self.tokens))

    def start(self, engine: ModelEngine) -> list[int]:
        """The prompt's tokens (prepared); from here on the job can take steps."""
        if self.on_start is not None:
            self.on_start()
        tokens = self.tokens
        self.decoding = Decoding(engine, self.params, self._emit, self.task_id, tokens)
        self.decoding.prompt_tokens = self.prompt_tokens = len(tokens)
        self.detokenizer = engine.tokenizer.detokenizer
        return tokens

    def step(self, token: int, logprobs: Any, finish_reason: str | None) -> GenerationResult | None:
        """One generated token, as stream_generate would report it; the result once the job ends."""
        assert self.decoding is not None
        self.generated += 1
        if self.choices is not None and ranks_candidates(self.params):
            self.logprob += float(logprobs[token].item())  # the model's, after any logits processors
        if finish_reason != "stop":  # "stop" is an EOS token: stream_generate does not decode it either
            self.detokenizer.add_token(token)
        if finish_reason is not None:
            self.detokenizer.finalize()
        text = self.detokenizer.last_segment
        result = self.decoding.step(text, token, logprobs, self.prompt_tokens, self.generated, finish_reason)
        if result is None and finish_reason is not None:
            result = self.decoding.finish()
        return result

    def cancelled(self) -> GenerationResult:
        return self.decoding.cancelled() if self.decoding else GenerationResult("cancelled", 0, 0)


class Batcher:
    """Owns the BatchGenerator. `submit` is called on the event loop, everything else on the model thread."""

    def __init__(self, engine: ModelEngine, limit: int, model_thread: Executor) -> None:
        self._engine = engine
        self._limit = limit
        self._model_thread = model_thread
        # Prompts are tokenized here, never on the model thread, so one long prompt does not stall
        # the batch (mlx_lm.server tokenizes on its generation thread, and stalls). One thread: jobs join in order.
        self._tokenizing = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize")
        self.preparing = 0  # jobs being tokenized: not yet the model thread's (Runner._pulse)
        self._lock = threading.Lock()
        self._inbox: list[Job] = []
        self._driving = False  # a drive loop is queued or running on the model thread
        self._generator: BatchGenerator | None = None
        self._jobs: dict[int, Job] = {}  # BatchGenerator uid -> job
        self._scopes: dict[int, str] = {}  # BatchGenerator uid -> its cache scope, until its cache is kept
        self._owners: dict[int, TaskId] = {}  # BatchGenerator uid -> its task, whose entry its cache becomes
        # Multi-node: what the other ranks have not been told yet (see BatchStep).
        self._agreed: AgreedSamplers | None = None
        self._new_batch = False
        self._joins: list[BatchJoin] = []
        self._leaves: list[int] = []
        self._fanning: dict[int, tuple[Job, BatchJoin]] = {}  # first choices in prefill, by uid (_fan_out_ready)

    def run(self, loop: asyncio.AbstractEventLoop, params: GenerationParams, defaults: SamplingDefaults,
            on_output: OnOutput, is_cancelled: Callable[[], bool], task_id: TaskId,
            on_start: Callable[[], None] | None = None, adapter_path: str = "") -> asyncio.Future[GenerationResult]:
        """Generates in the batch; the future resolves after every output of the job was scheduled on `loop`.
        `on_start`: called on the model thread as the job joins the batch (its queue wait ends: runner/traces.py)."""
        future: asyncio.Future[GenerationResult] = loop.create_future()
        with self._lock:
            self.preparing += 1
        job = Job(params, defaults, on_output, is_cancelled, task_id,
                  lambda outcome: None if loop.call_soon_threadsafe(_settle, future, outcome) else None)
        job.on_start, job.adapter_path = on_start, adapter_path
        if rows_of(params) > 1:
            first_of_choices(job)
        self._tokenizing.submit(self._prepare, job)
        return future

    def _prepare(self, job: Job) -> None:
        """On the tokenizing thread: the job joins the batch once its prompt is tokens that fit."""
        try:
            if job.is_cancelled():
                job.on_done(job.cancelled())
                return
            job.prepare(self._engine)
        except Exception as error:
            job.on_done(error)
            return
        finally:
            with self._lock:
                self.preparing -= 1
        self.submit(job)

    def submit(self, job: Job) -> None:
        with self._lock:
            self._inbox.append(job)
            if self._driving:
                return
            self._driving = True
        self._model_thread.submit(self._drive)

    def _drive(self) -> None:
        """Steps the batch until it and the inbox are empty; then the model thread is free again."""
        try:
            while self._take_new():
                self._step()
        except Exception as error:  # a bug here must end the requests, not hang them
            log.exception("the batch failed")
            self._fail_all(error)
            with self._lock:
                self._driving = again = bool(self._inbox)
            if again:
                self._model_thread.submit(self._drive)

    def _take_new(self) -> bool:
        with self._lock:
            new, self._inbox = self._inbox, []
            if not new and not self._jobs:
                self._driving = False
                return False
        for job in new:
            self._insert(job)
        return True

    def _insert(self, job: Job) -> None:
        try:
            params, tokens, max_tokens = job.params, job.start(self._engine), job.max_tokens
            reuse = self._engine.prompt_cache.take(tokens, scope=params.cache_scope)
            assert job.decoding is not None
            job.decoding.cached = reuse.cached
            generator = self._batch()
            self._hold_adapter(job, job.adapter_path)
            join = BatchJoin(tokens=tokens, max_tokens=max_tokens, cached=reuse.cached, cache_scope=params.cache_scope,
                             sampling=sampling_of(params, job.defaults, vocabulary_size(self._engine.model)),
                             logit_bias=params.logit_bias, repetition_penalty=params.repetition_penalty,
                             repetition_context_size=params.repetition_context_size,
                             presence_penalty=params.presence_penalty, frequency_penalty=params.frequency_penalty,
                             adapter=self._adapter_ref(job))
            sampler = self._row_sampler(params, join, job.choice)
            uid = insert(generator, join, sampler, reuse, self._engine.constraint_for(params, tokens))
        except Exception as error:
            job.on_done(error)
            return
        self._jobs[uid], self._scopes[uid], self._owners[uid] = job, join.cache_scope, job.task_id
        if self._lockstep() is not None:
            self._joins.append(join)
        if job.choices is not None and len(reuse.rest) > 1:  # mlx-lm's first segment ends before the last token
            self._fanning[uid] = job, join
        elif job.choices is not None and reuse.cache is not None:  # the prompt is cached: the first choice keeps that cache
            self._fan_out(job, join, copy.deepcopy(reuse.cache))

    def _hold_adapter(self, job: Job, path: str) -> None:
        """The job's adapter resident and held for its rows until it ends (on_done, on this thread)."""
        adapters = resident_adapters(self._engine)
        if not path:
            return
        if adapters is None:
            raise RequestRefused("this model takes no LoRA adapter per request")
        adapters.hold(self._engine.model, path, job)
        done = job.on_done

        def released(outcome: Outcome) -> None:
            adapters.release(job)
            done(outcome)

        job.on_done = released

    def _adapter_ref(self, job: Job) -> AdapterRef | None:
        """Multi-node: the job's adapter as the other ranks make it resident and select it for its rows."""
        adapters = resident_adapters(self._engine)
        name = adapters.held_by(job) if adapters is not None and self._lockstep() is not None else None
        return None if adapters is None or name is None else adapters.ref_of(name)

    def _row_sampler(self, params: GenerationParams, join: BatchJoin, choice: int) -> Sampler:
        if params.seed is not None and self._lockstep() is None:
            return seeded_sampler(*join.sampling, row_seed(params.seed, choice))
        return self._sampler(join.sampling)

    def _fan_out_ready(self, prompts: list[Any]) -> None:
        """First choices whose prompt, all but its last token, was just processed: the others join now."""
        for response in prompts:
            if response.end_of_segment and not response.end_of_prompt and response.uid in self._fanning:
                job, join = self._fanning.pop(response.uid)
                ((cache, _),) = self._batch().extract_cache([response.uid]).values()
                self._fan_out(job, join, cache)
        for gone in [uid for uid in self._fanning if uid not in self._jobs]:  # cancelled in prefill
            del self._fanning[gone]

    def _fan_out(self, first: Job, join: BatchJoin, cache: list[Any]) -> None:
        """The other choices of `first`'s request join from `cache` (its prompt but the last token), each
        with only that token to process. They share `cache`: mlx-lm merges it into the batch, never writes it."""
        assert first.choices is not None and first.decoding is not None
        first.choices.fanned_out = True
        reuse = Reuse(cache=cache, rest=join.tokens[-1:], cached=len(join.tokens) - 1)
        for choice in range(1, first.choices.rows):
            row = sibling(first, choice)
            try:
                row.start(self._engine)
                self._hold_adapter(row, first.adapter_path)
                assert row.decoding is not None
                row.decoding.cached = first.decoding.cached
                uid = insert(self._batch(), join, self._row_sampler(row.params, join, choice), reuse,
                             self._engine.constraint_for(row.params, join.tokens))
            except Exception as error:
                row.on_done(error)
                return
            self._jobs[uid] = row  # no cache scope: the first choice's cache is the one kept

    def warm_up(self) -> None:
        """Two sampled requests in a throwaway batch, after Engine.warm_up: sampling a batch's rows
        compiles kernels of its own (seconds on a CPU). No stop tokens and a fixed max_tokens, so every
        rank of an instance takes the same steps whatever it samples; the prompt cache is not touched."""
        engine = self._engine
        warm_up_batch(engine.model, engine.encode(engine.prompt_for(GenerationParams(messages=[]), text="warm up")))

    def _lockstep(self) -> Lockstep | None:
        return self._engine.lockstep

    def _sampler(self, sampling: Sampling) -> Sampler:
        lockstep = self._lockstep()
        if lockstep is None:
            return _shared_sampler(*sampling)
        if self._agreed is None:
            self._agreed = AgreedSamplers(lockstep)
        return self._agreed.get(sampling)

    def _batch(self) -> BatchGenerator:
        if self._generator is None or _base_of(self._generator.model) is not self._engine.model:
            adapters, model = resident_adapters(self._engine), self._engine.model
            rows = model if adapters is None else RowSelectingModel(model, adapters, self._jobs.get)
            self._generator = new_generator(rows, self._engine.tokenizer, self._limit)
            # The other ranks start a new batch too; what they were told of the old one is moot.
            self._new_batch, self._leaves, self._scopes, self._fanning, self._owners = True, [], {}, {}, {}
            if self._agreed is not None:
                self._agreed.clear()
        return self._generator

    def _step(self) -> None:
        if not self._jobs:
            return
        try:
            self._tell_the_other_ranks()
            prompts, responses = self._batch().next()
            self._engine.beat()  # prefill chunks produce no token, but they are progress
            self._fan_out_ready(prompts)
        except Exception as error:
            log.exception("a batch step failed")
            self._fail_all(error)
            return
        leaving = [r.uid for r in responses if self._on_token(r.uid, r.token, r.logprobs, r.finish_reason)]
        leaving += self._end_cancelled()
        finished, cache = [r for r in responses if r.finish_reason], self._engine.prompt_cache
        if finished or leaving:
            generator = self._batch()
            keep_caches(cache, generator, finished, leaving, self._scopes, self._owners)
            cache.trim(generator.prompt_cache_nbytes if cache.enabled else 0)  # running requests count too
        self._leaves += leaving if self._lockstep() is not None else []

    def _tell_the_other_ranks(self) -> None:
        """Multi-node: the step every rank takes next, in the order rank 0 took it (new, leave, join)."""
        lockstep = self._lockstep()
        if lockstep is None:
            return
        step = BatchStep(new_batch=self._limit if self._new_batch else 0, leaves=self._leaves, joins=self._joins,
                         cache_entries=self._engine.prompt_cache.entries)
        self._new_batch, self._leaves, self._joins = False, [], []
        lockstep.announce(step)

    def _on_token(self, uid: int, token: int, logprobs: Any, finish_reason: str | None) -> bool:
        """Feeds one token to its job; True if the job ended while mlx-lm still holds it."""
        job = self._jobs[uid]
        try:
            result: Outcome | None = job.step(token, logprobs, finish_reason)
        except Exception as error:
            log.exception("request %s failed", job.task_id)
            result = error
        if result is None:
            return False
        del self._jobs[uid]
        job.on_done(result)
        return finish_reason is None

    def _end_cancelled(self) -> list[int]:
        """Cancelled jobs, in prefill or decoding, end now (the single path checks after each token too)."""
        cancelled = [uid for uid, job in self._jobs.items() if job.is_cancelled()]
        for uid in cancelled:
            job = self._jobs.pop(uid)
            job.on_done(job.cancelled())
        return cancelled

    def _fail_all(self, error: BaseException) -> None:
        jobs, self._jobs, self._generator, self._joins, self._scopes = list(self._jobs.values()), {}, None, [], {}
        self._owners = {}
        failed = BatchFailed(f"{type(error).__name__}: {error}")
        for job in jobs:
            job.on_done(failed)


def resident_adapters(engine: ModelEngine) -> ResidentAdapters | None:
    adapters = getattr(engine, "adapters", None)  # text engines only
    return adapters if isinstance(adapters, ResidentAdapters) else None


def _base_of(model: Any) -> Any:
    return model.base if isinstance(model, RowSelectingModel) else model


def _settle(future: asyncio.Future[GenerationResult], outcome: Outcome) -> None:
    if future.done():
        return
    if isinstance(outcome, BaseException):
        future.set_exception(outcome)
    else:
        future.set_result(outcome)
