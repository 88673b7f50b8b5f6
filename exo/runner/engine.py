"""The thin layer over mlx-lm. One thread owns mlx: every method here runs on it."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar

import mlx.core as mx
from mlx_lm import load, stream_generate
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p, make_logits_processors, make_sampler

from exo.core.chat_template import encode_prompt, render_prompt, template_messages
from exo.core.grammar import grammar_of, tool_call_grammar
from exo.core.ids import TaskId
from exo.core.kv_budget import kv_group_size
from exo.core.prompt_length import token_chars, too_long
from exo.core.requests import GenerationParams, TokenLogprob, TopLogprob
from exo.core.reservations import DEFAULT_MAX_TOKENS
from exo.core.types import SamplingDefaults
from exo.memory import memory
from exo.runner import prefill
from exo.runner.adapter_rows import ResidentAdapters
from exo.runner.constraint import GrammarConstraint
from exo.runner.decoding import Decoding, GenerationResult, OnOutput, PromptTooLong, RequestRefused, TextStream
from exo.runner.distributed import Lockstep, Sampler, Sampling, StepAnnouncement, join_ring, load_shard
from exo.runner.prompt_cache import FOLLOWER_BUDGET, PromptCache, Reuse, budget_bytes
from exo.runner.protocol import RankSetup, Resume
from exo.runner.splitter import starts_in_reasoning
from exo.settings.services import RunnerSettings

LOGPROB_FLOOR = -9999.0  # what OpenAI sends for a token with no chance at all
PENALTY_CONTEXT = 256  # more than mlx-lm's penalties look back at (20 tokens by default)
ALL_TOKENS = 2**31 - 1  # a repetition context of every token (mlx slices take 32-bit bounds)
# The sampled warm-up's settings. Most of the compile time is shared by every setting; a request
# with another temperature or top_p still compiles the one kernel that embeds its value.
WARM_UP_TEMPERATURE, WARM_UP_TOP_P = 0.7, 0.9

# mlx-lm's logits processor: (the tokens so far, the next token's logits) -> the logits to sample from.
LogitsProcessor = Callable[[mx.array, mx.array], mx.array]
N = TypeVar("N", int, float)


class Engine:
    def __init__(self, settings: RunnerSettings = RunnerSettings()) -> None:
        self.settings = settings
        self.model: Any = None
        self.tokenizer: Any = None
        self.lockstep: Lockstep | None = None  # set when this runner is one rank of a multi-node instance
        self.prompt_cache = PromptCache(None, max_bytes=0)
        self.pulse = time.monotonic()  # when the model thread last made progress (see Runner._pulse)
        self.context_length = 0  # the model's (max_position_embeddings), 0 if it does not say
        self.token_chars = 0  # the most characters of text one token covers (prompt_for's bound); 0: unknown
        self.kv_bits = 0  # > 0: the KV cache is quantized to this many bits from the first token
        self.batches = True
        self.draft_model: Any = None  # speculative decoding's draft (load_draft); mlx-lm's batches take none
        self.num_draft_tokens = 0
        self.adapters = ResidentAdapters(settings.resident_adapters)  # per request (EXO_ADAPTERS_SHARE_BASE)

    def load(self, model_path: str, shard: RankSetup | None = None, max_context: int = 0, kv_bits: int = 0,
             adapter_path: str = "") -> None:
        """`adapter_path`: a LoRA adapter applied as mlx_lm.load(adapter_path=...) applies it."""
        self.kv_bits = kv_bits
        if shard is None:
            self.model, self.tokenizer = load(model_path, adapter_path=adapter_path or None)
        else:
            group = join_ring(shard.rank, shard.ring_hosts, self.settings.ring_join_timeout_s)
            self.model, self.tokenizer = load_shard(model_path, group, shard.sharding, shard.start_layer, shard.end_layer,
                                                    adapter_path)
            self.lockstep = Lockstep(group)
        # The budget comes from the memory free once the model is in it. On a multi-node instance
        # rank 0 decides which entries every rank keeps (its byte count; see PromptCache.trim).
        self.context_length = int(getattr(getattr(self.model, "args", None), "max_position_embeddings", 0) or 0)
        if kv_bits and not self._group_size():
            raise ValueError("this model's KV cache cannot be quantized: its head dim is not a multiple of 32")
        if max_context:  # what placement reserved KV cache for: no request may outgrow it
            self.context_length = min(self.context_length or max_context, max_context)
        self.token_chars = token_chars(self.tokenizer)
        budget = budget_bytes(self.settings.prompt_cache_bytes, memory()[1]) if shard is None or shard.rank == 0 \
            else FOLLOWER_BUDGET
        self.prompt_cache = PromptCache(self.model, budget, self.settings.prompt_cache_entries)

    def release_followers(self) -> None:
        if self.lockstep is not None and self.lockstep.leads:
            self.lockstep.announce(None)

    def warm_up(self) -> None:
        """A short greedy and a short sampled generation, so the first real request of either kind
        does not wait while MLX compiles their kernels (seconds on a CPU, then cached on disk in the
        temp dir's mlx/). The batch runs the same kernels. Neither touches the prompt cache; the
        sampled one draws from the unseeded global random state, as an unseeded request would."""
        prompt = self.prompt_for(GenerationParams(messages=[]), text="warm up")
        for _ in stream_generate(self.model, self.tokenizer, prompt, max_tokens=2):
            pass
        # One token: ranks of an instance may sample different ones, and one that sampled EOS stops;
        # its next step was queued already, so every rank runs the same collectives.
        sampler = make_sampler(temp=WARM_UP_TEMPERATURE, top_p=WARM_UP_TOP_P)
        for _ in stream_generate(self.model, self.tokenizer, prompt, max_tokens=1, sampler=sampler):
            pass

    def prompt_for(self, params: GenerationParams, text: str | None = None) -> str:
        """The prompt's text; PromptTooLong, before any templating, for text too long to fit whatever it tokenizes to."""
        if text is None and (why := too_long(params, self.context_length, self.token_chars)) is not None:
            raise PromptTooLong(why)
        if params.prompt is not None and text is None:
            return params.prompt  # completions: the caller's text is the whole prompt
        messages = template_messages(params) if text is None else [{"role": "user", "content": text}]
        return render_prompt(self.tokenizer, messages, params.tools, params.enable_thinking)

    def generate(self, params: GenerationParams, defaults: SamplingDefaults, on_output: OnOutput,
                 is_cancelled: Callable[[], bool], task_id: TaskId = TaskId(""), told: StepAnnouncement | None = None,
                 images: Sequence[str] = (), resume: Resume | None = None) -> GenerationResult:
        """One request alone. `told`: rank 0's announcement of it, on the other ranks of an instance.
        `resume`: a generation another runner began (a migration): its tokens so far are prefilled
        after the prompt and it goes on from there, sending only what comes after their text."""
        if images:  # a card that says supports_images over a text-only model: say so, not answer blind
            raise RequestRefused("this model has no vision tower: it cannot take images (its card says it can)")
        tokens = self.encode(self.prompt_for(params))
        prior = list(told.resume_tokens if told is not None else resume.token_ids if resume is not None else [])
        if told is None:  # rank 0, before any collective: read back from JetStream, so anyone's to write
            self._check_token_ids(prior)
            check_logit_bias(params.logit_bias, vocabulary_size(self.model))
        max_tokens = self.max_tokens_for(params, len(tokens)) - len(prior)  # what the whole request may still add
        decoding = Decoding(self, params, on_output, task_id, tokens)
        stream = TextStream(self.tokenizer) if prior else None  # resumed: its own text (see TextStream)
        if stream is not None and (ended := self._replay(decoding, stream, prior, len(tokens), max_tokens)):
            return ended
        sampler = sampler_of(params, defaults, vocabulary_size(self.model), start=len(prior))
        processors = [*logits_processors_of(params), *self.constraint_for(params, tokens, prior)]
        # The draft proposes tokens only where mlx-lm's speculative step gives the plain path's tokens:
        # no logits processors (it shows them the generated tokens only), no resumed run, one node.
        drafting = self.draft_model is not None and not processors and not prior and self.lockstep is None
        reuse = Reuse(cache=None, rest=tokens, cached=0) if drafting else self._reuse(tokens + prior, params.cache_scope, told)
        decoding.cached = min(reuse.cached, len(tokens))
        if self.lockstep is not None:  # every rank takes rank 0's tokens and stops when rank 0 does
            sampler, is_cancelled = self._in_lockstep(sampler, is_cancelled, StepAnnouncement(
                task_id=task_id, params=params, defaults=defaults, cached=reuse.cached,
                cache_entries=self.prompt_cache.entries, resume_tokens=prior,
                adapter=self.adapters.selected_ref() if told is None else None))
        generated: list[int] = []
        result = None
        draft = {"draft_model": self.draft_model, "num_draft_tokens": self.num_draft_tokens} if drafting else {}
        for response in stream_generate(
            self.model, self.tokenizer, mx.array(reuse.rest), max_tokens=max_tokens,
            sampler=sampler, logits_processors=_seeing_prefix(processors, (tokens + prior)[:reuse.cached], params),
            prompt_cache=reuse.cache, prompt_progress_callback=lambda *_: self.beat(), **self._quantized_cache(), **draft,
            prefill_step_size=prefill.PREFILL_STEP,  # a beat after every chunk (see prefill.py)
        ):
            generated.append(response.token)
            decoding.draft_tokens += int(response.from_draft)
            text = response.text if stream is None else stream.add(response.token, response.finish_reason)
            result = decoding.step(text, response.token, response.logprobs, len(tokens),
                                   len(prior) + response.generation_tokens, response.finish_reason)
            if result is None and is_cancelled():
                result = decoding.cancelled()
            if result is not None:
                break
        # Every token stream_generate reported went through the model: the cache holds them all.
        if reuse.cache is not None:  # none with a draft: both models' caches would have to be kept in step
            self.prompt_cache.keep(tokens + prior + generated, reuse.cache, scope=params.cache_scope, owner=task_id)
            self._trim_cache()
        return result or decoding.finish()

    def load_draft(self, draft_path: str, num_draft_tokens: int) -> None:
        """Speculative decoding's draft: a smaller model of the same vocabulary, beside this one."""
        draft, draft_tokenizer = load(draft_path)
        if draft_tokenizer.get_vocab() != self.tokenizer.get_vocab():
            raise ValueError(f"the draft model's vocabulary ({len(draft_tokenizer.get_vocab())} tokens) is not the "
                             f"model's ({len(self.tokenizer.get_vocab())}): it cannot propose this model's tokens")
        self.draft_model, self.num_draft_tokens = draft, num_draft_tokens

    def _replay(self, decoding: Decoding, stream: TextStream, prior: list[int], prompt_tokens: int,
                left: int) -> GenerationResult | None:
        """A resumed request's earlier tokens through `decoding`, unsent; the result if they ended it: a
        stop string, or the earlier run's last Output went out (its EOS, or the last token it was allowed)."""
        end = "stop" if prior[-1] in self.tokenizer.eos_token_ids else "length" if left <= 0 else None
        last = len(prior) - 1
        steps = ((token, stream.add(token, end if n == last else None), end if n == last else None)
                 for n, token in enumerate(prior))
        return decoding.replay(steps, prompt_tokens)

    def _in_lockstep(self, sampler: Sampler, is_cancelled: Callable[[], bool],
                     announcement: StepAnnouncement) -> tuple[Sampler, Callable[[], bool]]:
        """Rank 0 tells the other ranks what to run; every rank samples rank 0's tokens."""
        assert self.lockstep is not None
        if self.lockstep.leads:
            self.lockstep.announce(announcement)
        return self.lockstep.start(sampler, is_cancelled)

    def _check_token_ids(self, ids: list[int]) -> None:
        vocab = vocabulary_size(self.model)
        bad = next((i for i in ids if i < 0 or (vocab and i >= vocab)), None)
        if bad is not None:
            raise RequestRefused(f"the streamed tokens read back for this generation are not this model's "
                                 f"(token id {bad}; its vocabulary has {vocab}): it cannot be continued")

    def constraint_for(self, params: GenerationParams, prompt: list[int], prior: Sequence[int] = ()) -> list[LogitsProcessor]:
        """The request's response_format, or its required tool call, as a logits processor, on the
        rank that samples (the others take its tokens). `prior`: a resumed request's earlier tokens."""
        if self.lockstep is not None and not self.lockstep.leads:
            return []
        if params.response_format is not None:
            try:
                grammar = grammar_of(params.response_format)
            except ValueError as error:  # as below: the API's check was passed by
                raise RequestRefused(str(error)) from None
        elif params.tools_required and params.tools:
            grammar = self._tool_call_grammar(params.tools)
        else:
            return []
        in_reasoning = params.prompt is None and starts_in_reasoning(self.tokenizer, prompt)
        try:
            constraint = GrammarConstraint(self.tokenizer, grammar, in_reasoning)
        except ValueError as error:  # the API checks grammars; one that got past it is refused, not a crash
            raise RequestRefused(str(error)) from None
        constraint.advance(list(prior))
        return [constraint]

    def _tool_call_grammar(self, tools: list[dict[str, Any]]) -> str:
        parser = getattr(getattr(self.tokenizer, "tool_parser", None), "__module__", "") or ""
        if not parser.endswith(".json_tools"):
            kind = parser.rsplit(".", 1)[-1] or "none"
            raise RequestRefused(f"a required tool call cannot be enforced for this model's tool-call format "
                                 f"({kind}); only JSON tool calls (json_tools: Qwen, Hermes and the like) can be")
        start, end = self.tokenizer.tool_call_start_tokens, self.tokenizer.tool_call_end_tokens
        return tool_call_grammar(tools, list(start), list(end))

    def _quantized_cache(self) -> dict[str, int]:
        # From the first token: placement reserved memory for a quantized cache of the whole context.
        if not self.kv_bits:
            return {}
        return {"kv_bits": self.kv_bits, "kv_group_size": self._group_size(), "quantized_kv_start": 0}

    def _group_size(self) -> int:
        args = self.model.args
        return kv_group_size(getattr(args, "head_dim", None) or args.hidden_size // args.num_attention_heads)

    def max_tokens_for(self, params: GenerationParams, prompt_tokens: int) -> int:
        """The request's max_tokens, within what the model's context leaves after the prompt."""
        if not self.context_length:
            return max_tokens_of(params)
        if prompt_tokens >= self.context_length:
            raise PromptTooLong(f"the prompt is {prompt_tokens} tokens; this instance's context is {self.context_length}")
        return min(max_tokens_of(params), self.context_length - prompt_tokens)

    def beat(self) -> None:
        """The model thread made progress (a token, a prefill chunk, a batch step)."""
        self.pulse = time.monotonic()

    def _reuse(self, tokens: list[int], scope: str, told: StepAnnouncement | None) -> Reuse:
        if told is None:
            return self.prompt_cache.take(tokens, scope=scope)
        self.prompt_cache.trim(entries=told.cache_entries)  # drop what rank 0 dropped before it took this
        return self.prompt_cache.take(tokens, scope=scope, expect=told.cached)

    def _trim_cache(self, active_bytes: int = 0) -> None:
        """Keep the cache in its budget; rank 0 only (the others drop what rank 0 tells them to)."""
        if self.lockstep is None or self.lockstep.leads:
            self.prompt_cache.trim(active_bytes)

    def encode(self, prompt: str) -> list[int]:
        """The prompt's token ids exactly as stream_generate makes them from the same text."""
        return encode_prompt(self.tokenizer, prompt)

    def logprob(self, token: int, logprobs: Any, top: int) -> TokenLogprob:
        """The sampled token's logprob and the `top` likeliest, each at least LOGPROB_FLOOR: a token a
        constraint masked has -inf, which JSON cannot carry (the sampled one is finite: Decoding checks)."""
        logprobs = logprobs.reshape(-1)
        alternatives: list[TopLogprob] = []
        top = min(top, logprobs.size - 1)
        if top > 0:
            ids = mx.argpartition(-logprobs, kth=top - 1)[:top]
            ranked: list[Any] = sorted(zip(ids.tolist(), logprobs[ids].tolist(), strict=True), key=lambda pair: -pair[1])  # type: ignore[arg-type]
            alternatives = [TopLogprob(token=self._token_text(i), logprob=floored(v)) for i, v in ranked]
        return TokenLogprob(token=self._token_text(token), logprob=floored(logprobs[token].item()),
                            top_logprobs=alternatives)

    def _token_text(self, token: int) -> str:
        text: str = self.tokenizer.decode([token])
        return text


def floored(logprob: float) -> float:
    """OpenAI's floor for a logprob: -inf (and NaN, which only a masked alternative can be here) as -9999."""
    return logprob if logprob > LOGPROB_FLOOR else LOGPROB_FLOOR


def max_tokens_of(params: GenerationParams) -> int:
    return params.max_tokens or DEFAULT_MAX_TOKENS


class Penalized(Protocol):
    """A request's logits-processor settings: GenerationParams, or a BatchJoin on every rank."""

    @property
    def logit_bias(self) -> dict[int, float]: ...
    @property
    def repetition_penalty(self) -> float | None: ...
    @property
    def repetition_context_size(self) -> int: ...
    @property
    def presence_penalty(self) -> float | None: ...
    @property
    def frequency_penalty(self) -> float | None: ...


def logits_processors_of(settings: Penalized) -> list[LogitsProcessor]:
    """mlx-lm's own processors for the request's logit_bias and penalties (check_logit_bias first)."""
    processors: list[LogitsProcessor] = make_logits_processors(
        logit_bias=settings.logit_bias or None, repetition_penalty=settings.repetition_penalty,
        repetition_context_size=_repetition_context(settings.repetition_context_size),
        presence_penalty=settings.presence_penalty, frequency_penalty=settings.frequency_penalty)
    return processors


def _repetition_context(size: int) -> int:
    return ALL_TOKENS if size < 0 else size  # -1: Ollama's num_ctx, the whole context


def vocabulary_size(model: Any) -> int:
    """How many logits the model gives (0: unknown): mlx-lm's `args`, or mlx-vlm's text config."""
    args = getattr(model, "args", None) or getattr(getattr(model, "config", None), "text_config", None)
    return int(getattr(args, "vocab_size", 0) or 0)


def check_logit_bias(logit_bias: dict[int, float], vocab_size: int) -> None:
    """RequestRefused for a biased token id the model does not have (the API knows no vocabulary):
    mlx would write outside the logits with it."""
    if not logit_bias:
        return
    if not vocab_size:
        raise RequestRefused("logit_bias cannot be applied: this model's vocabulary size is unknown")
    bad = sorted(token for token in logit_bias if not 0 <= token < vocab_size)
    if bad:
        raise RequestRefused(f"logit_bias has token ids outside this model's vocabulary (0 to {vocab_size - 1}): "
                             f"{', '.join(map(str, bad[:5]))}")


def _seeing_prefix(processors: list[LogitsProcessor], prefix: list[int], settings: Penalized) -> list[LogitsProcessor]:
    """Penalties look at the last tokens of the prompt too; stream_generate gives them only the
    tokens it processes, so put back the cached prefix's (as the batch's token context has them)."""
    if not processors or not prefix:
        return processors
    repetition = _repetition_context(settings.repetition_context_size) if settings.repetition_penalty else 0
    before = mx.array(prefix[-max(PENALTY_CONTEXT, repetition):])

    def seeing(processor: LogitsProcessor) -> LogitsProcessor:
        return lambda tokens, logits: processor(mx.concatenate([before, tokens.astype(before.dtype)]), logits)

    return [seeing(p) for p in processors]


def sampling_of(params: GenerationParams, defaults: SamplingDefaults, vocab_size: int) -> Sampling:
    """(temperature, top_p, top_k, min_p) for make_sampler: the request's, else the card's defaults.
    A top_k of the whole vocabulary keeps every token: off (mlx-lm refuses it, failing the batch)."""
    temperature = _first(params.temperature, defaults.temperature, 0.0)
    top_p = _first(params.top_p, defaults.top_p, 0.0)
    top_k = _first(params.top_k, defaults.top_k, 0)
    min_p = _first(params.min_p, defaults.min_p, 0.0)
    return temperature, top_p if top_p < 1.0 else 0.0, 0 if vocab_size and top_k >= vocab_size else top_k, min_p


def sampler_of(params: GenerationParams, defaults: SamplingDefaults, vocab_size: int, start: int = 0) -> Sampler:
    """`start`: how many tokens the request generated before (resumed), so a seed draws on from there."""
    temperature, top_p, top_k, min_p = sampling_of(params, defaults, vocab_size)
    if params.seed is not None:
        return seeded_sampler(temperature, top_p, top_k, min_p, params.seed, start)
    sampler: Sampler = make_sampler(temp=temperature, top_p=top_p, top_k=top_k, min_p=min_p)
    return sampler


def seeded_sampler(temperature: float, top_p: float, top_k: int, min_p: float, seed: int, start: int = 0) -> Sampler:
    """make_sampler's sampling with a random key of the request's own: the same tokens as
    `mx.random.seed(seed)` then make_sampler (mlx-lm's reference), however many other requests
    draw from the global random state meanwhile. So a seeded request can share a batch.
    `start`: the draw to begin at (a resumed request's earlier tokens took the ones before)."""
    if temperature == 0:
        greedy: Sampler = make_sampler(temp=0.0)
        return greedy
    key = mx.random.key(seed)
    for _ in range(start):  # each draw splits the key once: step along the same chain
        key = mx.random.split(key)[0]

    def sample(logprobs: mx.array) -> mx.array:
        nonlocal key
        if 0 < top_p < 1.0:  # make_sampler's filters, in its order
            logprobs = apply_top_p(logprobs, top_p)
        if min_p != 0.0:
            logprobs = apply_min_p(logprobs, min_p)
        if top_k > 0:
            logprobs = apply_top_k(logprobs, top_k)
        key, draw = mx.random.split(key)  # what mlx's global key sequence does on each draw
        return mx.random.categorical(logprobs * (1.0 / temperature), key=draw)

    return sample


def _first(*values: N | None) -> N:
    return next(v for v in values if v is not None)
