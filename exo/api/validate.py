"""Small range checks every surface shares; each raises a 400 naming the parameter."""

from __future__ import annotations

import re
from typing import Any, TypeVar

import msgspec

from exo.api.errors import ApiError
from exo.core.kv_budget import KV_BITS, context_cap, least_context
from exo.core.prompt_length import API_CHARS_PER_TOKEN, too_long
from exo.core.requests import GenerationParams
from exo.core.types import ModelCard

# What one request may ask for. Everything in GenerationParams is stored in the log and in State,
# so what a request may put there is bounded, not only what the model can do with it.
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1000  # each
MAX_TOOLS_BYTES = 256 * 1024  # all tool definitions, as JSON
MAX_SCHEMA_BYTES = 64 * 1024  # a response_format's JSON schema
SEED_MAX = 2**64 - 1  # mlx.random.seed takes an unsigned 64-bit integer

N = TypeVar("N", int, float)


def in_range(value: N | None, low: N, high: N, param: str) -> N | None:
    if value is not None and not low <= value <= high:
        raise ApiError(400, f"{param} must be between {low} and {high}, got {value}", param=param)
    return value


def at_least_one(value: int | None, param: str) -> int | None:
    if value is not None and value < 1:
        raise ApiError(400, f"{param} must be at least 1, got {value}", param=param)
    return value


def check_limits(params: GenerationParams, context_length: int, max_tokens_limit: int) -> None:
    """The bounds every surface shares: max_tokens (the server's limit and the context its
    instances have room for), seed, stop strings and tool definitions. A 400 naming the parameter."""
    limit = min(max_tokens_limit, context_length) if context_length > 0 else max_tokens_limit
    if params.max_tokens is not None and params.max_tokens > limit:
        why = "the model's context" if limit == context_length else "this server's limit (EXO_MAX_TOKENS_LIMIT)"
        raise ApiError(400, f"max_tokens must be at most {limit} ({why}), got {params.max_tokens}", param="max_tokens")
    in_range(params.seed, 0, SEED_MAX, "seed")
    if len(params.stop) > MAX_STOP_STRINGS:
        raise ApiError(400, f"at most {MAX_STOP_STRINGS} stop strings, got {len(params.stop)}", param="stop")
    if any(len(s) > MAX_STOP_CHARS for s in params.stop):
        raise ApiError(400, f"each stop string must be at most {MAX_STOP_CHARS} characters", param="stop")
    if params.tools and len(msgspec.json.encode(params.tools)) > MAX_TOOLS_BYTES:
        raise ApiError(400, f"tool definitions must be at most {MAX_TOOLS_BYTES} bytes of JSON", param="tools")
    if params.response_format and len(msgspec.json.encode(params.response_format)) > MAX_SCHEMA_BYTES:
        raise ApiError(400, f"response_format must be at most {MAX_SCHEMA_BYTES} bytes of JSON", param="response_format")
    check_prompt_length(params, context_length)


def check_prompt_length(params: GenerationParams, context_length: int) -> None:
    """A prompt too long for the context by its length alone: refused here in microseconds, before
    the runner would spend seconds tokenizing it (exo/core/prompt_length.py)."""
    why = too_long(params, context_length, API_CHARS_PER_TOKEN)
    if why is not None:
        param = "input" if params.embed is not None else "prompt" if params.prompt is not None else "messages"
        raise ApiError(400, why, param=param, code="context_length_exceeded")


def check_max_context(max_context: int, card: ModelCard) -> int:
    """A placement's max_context: 0 (the most that fits) up to the model's context length."""
    cap, least = context_cap(card), least_context(card)
    if max_context != 0 and not least <= max_context <= cap:
        raise ApiError(400, f"max_context must be 0 (the most that fits) or between {least} (room for a short prompt "
                            f"and answer) and {cap} (the model's context), got {max_context}", param="max_context")
    return max_context


def check_kv_bits(kv_bits: int) -> int:
    if kv_bits and kv_bits not in KV_BITS:
        raise ApiError(400, f"kv_bits must be 0 (not quantized) or one of {list(KV_BITS)}, got {kv_bits}", param="kv_bits")
    return kv_bits


def stop_list(stop: str | list[str] | None) -> list[str]:
    return [stop] if isinstance(stop, str) else list(stop or [])


MAX_TOP_LOGPROBS = 20


def check_logprobs(logprobs: bool, top_logprobs: int | None) -> int:
    if top_logprobs is None:
        return 0
    if not 0 <= top_logprobs <= MAX_TOP_LOGPROBS:
        raise ApiError(400, f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}", param="top_logprobs")
    if top_logprobs and not logprobs:
        raise ApiError(400, "top_logprobs needs logprobs set to true", param="top_logprobs")
    return top_logprobs


def check_penalty(value: float | None, name: str) -> float | None:
    if value is not None and not -2 <= value <= 2:
        raise ApiError(400, f"{name} must be between -2 and 2", param=name)
    return value


MAX_LOGIT_BIAS = 300  # entries, as OpenAI
LOGIT_BIAS_LIMIT = 100  # each value within plus or minus this, as OpenAI
REPETITION_PENALTY_MAX = 10.0  # past it every recent token is gone anyway
REPEAT_LAST_N_MAX = 4096
OLLAMA_REPEAT_LAST_N = 64  # Ollama's default window for repeat_penalty
_TOKEN_ID = re.compile(r"[0-9]{1,10}")


def check_logit_bias(bias: dict[str, float] | None) -> dict[int, float]:
    """OpenAI's {"token id": bias}. Whether each id is in the model's vocabulary only its runner knows."""
    if not bias:
        return {}
    if len(bias) > MAX_LOGIT_BIAS:
        raise ApiError(400, f"logit_bias may have at most {MAX_LOGIT_BIAS} entries, got {len(bias)}", param="logit_bias")
    for key, value in bias.items():
        if not _TOKEN_ID.fullmatch(key):
            raise ApiError(400, f"logit_bias keys must be token ids (integers of 0 or more), got {key!r}", param="logit_bias")
        if not -LOGIT_BIAS_LIMIT <= value <= LOGIT_BIAS_LIMIT:
            raise ApiError(400, f"logit_bias values must be between -{LOGIT_BIAS_LIMIT} and {LOGIT_BIAS_LIMIT}, "
                                f"got {value} for token {key}", param="logit_bias")
    return {int(key): float(value) for key, value in bias.items()}


def check_repetition_penalty(value: float | None, name: str) -> float | None:
    if value is not None and not 0 < value <= REPETITION_PENALTY_MAX:
        raise ApiError(400, f"{name} must be above 0 and at most {REPETITION_PENALTY_MAX:g}, got {value}", param=name)
    return value


def openai_top_k(value: int | None) -> int | None:
    """vLLM's top_k: -1 or 0 is off (0 here, so it overrides a card's default), else at least 1."""
    if value is not None and value < -1:
        raise ApiError(400, f"top_k must be -1 or 0 (off) or at least 1, got {value}", param="top_k")
    return None if value is None else max(value, 0)


def sampling_extensions(top_k: int | None, min_p: float | None, repetition_penalty: float | None,
                        logit_bias: dict[str, float] | None) -> dict[str, Any]:
    """The OpenAI surfaces' sampling fields beyond OpenAI's (vLLM's and mlx_lm.server's), and
    logit_bias, validated, as GenerationParams fields."""
    return {"top_k": openai_top_k(top_k), "min_p": in_range(min_p, 0.0, 1.0, "min_p"),
            "repetition_penalty": check_repetition_penalty(repetition_penalty, "repetition_penalty"),
            "logit_bias": check_logit_bias(logit_bias)}
