"""POST /v1/completions in OpenAI's shapes: prompt text in, text out, no chat template."""

from __future__ import annotations

import time
from typing import Any

from aiohttp import web

from exo.api.choices import check_best_of, check_n, collect_choices, likeliest, newly_ended
from exo.api.context import context_of
from exo.api.errors import ApiError
from exo.api.generation import Generation, generating, requested_tier
from exo.api.keep_alive import keep_alive_seconds
from exo.api.openai.chat_stream import usage
from exo.api.openai.chat_wire import CompletionRequest
from exo.api.request_body import decode_body
from exo.api.sse import SseStream
from exo.api.structured import openai_constraint
from exo.api.validate import check_penalty, sampling_extensions
from exo.core.requests import GenerationParams, TokenLogprob

MAX_LOGPROBS = 5  # the completions API's own limit


def to_params(body: CompletionRequest) -> GenerationParams:
    prompt = body.prompt
    if isinstance(prompt, list):
        if len(prompt) != 1:
            raise ApiError(400, "prompt must be one string (a list of several prompts is not supported)", param="prompt")
        prompt = prompt[0]
    if not prompt:
        raise ApiError(400, "prompt must not be empty", param="prompt")
    n = check_n(body.n)
    best_of = check_best_of(body.best_of, n, body.stream)
    if body.echo or body.suffix:
        raise ApiError(400, "echo and suffix are not supported", param="echo" if body.echo else "suffix")
    if body.max_tokens is not None and body.max_tokens < 1:
        raise ApiError(400, "max_tokens must be at least 1", param="max_tokens")
    if body.temperature is not None and not 0 <= body.temperature <= 2:
        raise ApiError(400, "temperature must be between 0 and 2", param="temperature")
    if body.top_p is not None and not 0 <= body.top_p <= 1:
        raise ApiError(400, "top_p must be between 0 and 1", param="top_p")
    if body.logprobs is not None and not 0 <= body.logprobs <= MAX_LOGPROBS:
        raise ApiError(400, f"logprobs must be between 0 and {MAX_LOGPROBS}", param="logprobs")
    return GenerationParams(
        prompt=prompt, max_tokens=body.max_tokens, temperature=body.temperature, top_p=body.top_p, seed=body.seed,
        n=n, best_of=best_of,
        stop=[body.stop] if isinstance(body.stop, str) else list(body.stop or []),
        presence_penalty=check_penalty(body.presence_penalty, "presence_penalty"),
        frequency_penalty=check_penalty(body.frequency_penalty, "frequency_penalty"),
        **sampling_extensions(body.top_k, body.min_p, body.repetition_penalty, body.logit_bias),
        logprobs=body.logprobs is not None, top_logprobs=body.logprobs or 0,
        response_format=openai_constraint(body.constraints()),
    )


async def completions(request: web.Request) -> web.StreamResponse:
    body = await decode_body(request, CompletionRequest)
    params = to_params(body)
    tier = requested_tier(body.service_tier, body.priority)
    async with generating(context_of(request), body.model, params, tier=tier,
                          keep_alive_s=keep_alive_seconds(body.keep_alive)) as generation:
        if body.stream:
            return await _stream(request, generation, body)
        return await _complete(generation, body)


def _envelope(generation: Generation, model: str) -> dict[str, Any]:
    return {"id": f"cmpl-{generation.command_id}", "object": "text_completion", "created": int(time.time()), "model": model}


def _logprobs(entries: list[TokenLogprob], offset: int) -> dict[str, Any]:
    """The completions API's older logprobs shape: parallel lists, top alternatives as maps."""
    offsets, at = [], offset
    for entry in entries:
        offsets.append(at)
        at += len(entry.token)
    return {"tokens": [e.token for e in entries], "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{t.token: t.logprob for t in e.top_logprobs} for e in entries], "text_offset": offsets}


async def _complete(generation: Generation, body: CompletionRequest) -> web.Response:
    choices = await collect_choices(generation)
    if body.best_of is not None and body.best_of > body.n:
        choices = likeliest(choices, body.n)
    final = choices[0].final
    assert final is not None
    return web.json_response(_envelope(generation, body.model) | {
        "choices": [{"index": index, "text": done.text, "finish_reason": done.finish_reason,
                     "logprobs": _logprobs(done.logprobs, 0) if body.logprobs is not None else None}
                    for index, done in enumerate(choices)],
        "usage": usage(final)})


async def _stream(request: web.Request, generation: Generation, body: CompletionRequest) -> web.StreamResponse:
    """With n > 1, each event carries one choice's text (`choices[0].index` says which)."""
    sse = await SseStream.open(request)
    generation.tell_loading(sse.comment)
    base = _envelope(generation, body.model)
    offsets: dict[int, int] = {}  # by choice
    ended: set[int] = set()  # choices whose finish chunk was sent
    async for chunk in generation.chunks():
        event_id = f"{generation.command_id}:{chunk.index}"
        offset = offsets.get(chunk.choice, 0)
        logprobs = _logprobs(chunk.logprobs, offset) if body.logprobs is not None else None
        offsets[chunk.choice] = offset + len(chunk.text)
        if chunk.text or (logprobs and chunk.logprobs):
            await sse.send(base | {"choices": [{"index": chunk.choice, "text": chunk.text, "finish_reason": None,
                                                "logprobs": logprobs}]}, event_id=event_id)
        if chunk.finish_reason in ("error", "cancelled"):
            await sse.send({"error": {"message": chunk.error or "generation was cancelled", "type": "internal_error",
                                      "code": chunk.finish_reason}}, event_id=event_id)
            continue
        for index, reason in newly_ended(chunk, ended):  # each choice's at its own end
            await sse.send(base | {"choices": [{"index": index, "text": "", "finish_reason": reason, "logprobs": None}]},
                           event_id=event_id)
        if chunk.finish_reason and body.stream_options and body.stream_options.include_usage:
            await sse.send(base | {"choices": [], "usage": usage(chunk)}, event_id=event_id)
    await sse.send("[DONE]")
    return await sse.close()
