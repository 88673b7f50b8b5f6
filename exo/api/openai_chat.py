"""POST /v1/chat/completions in OpenAI's shapes, streaming (SSE) and not."""

from __future__ import annotations

import json
import time

import msgspec
from aiohttp import web

from exo.api.context import context_of
from exo.api.errors import ApiError
from exo.api.generation import Generation, start_generation
from exo.api.request_body import decode_body
from exo.core.types import ChatMessage, GenerationParams


class ContentPart(msgspec.Struct, kw_only=True):
    type: str
    text: str = ""


class ChatRequestMessage(msgspec.Struct, kw_only=True):
    role: str
    content: str | list[ContentPart] | None = None


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool = False


class ChatRequest(msgspec.Struct, kw_only=True):
    model: str
    messages: list[ChatRequestMessage]
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = 1


_ROLES = {"system", "developer", "user", "assistant", "tool"}


def to_params(body: ChatRequest) -> GenerationParams:
    if not body.messages:
        raise ApiError(400, "messages must contain at least one message", param="messages")
    if body.n != 1:
        raise ApiError(400, "only n=1 is supported", param="n")
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    if max_tokens is not None and max_tokens < 1:
        raise ApiError(400, "max_tokens must be at least 1", param="max_tokens")
    if body.temperature is not None and not 0 <= body.temperature <= 2:
        raise ApiError(400, "temperature must be between 0 and 2", param="temperature")
    if body.top_p is not None and not 0 <= body.top_p <= 1:
        raise ApiError(400, "top_p must be between 0 and 1", param="top_p")
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    return GenerationParams(
        messages=[_to_message(i, m) for i, m in enumerate(body.messages)],
        max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p, seed=body.seed, stop=stop,
    )


def _to_message(index: int, message: ChatRequestMessage) -> ChatMessage:
    if message.role not in _ROLES:
        raise ApiError(400, f"messages[{index}].role must be one of {sorted(_ROLES)}", param=f"messages[{index}].role")
    content = message.content
    if isinstance(content, list):
        unsupported = [p.type for p in content if p.type != "text"]
        if unsupported:
            raise ApiError(400, f"content part type {unsupported[0]!r} is not supported yet", param=f"messages[{index}].content")
        content = "".join(p.text for p in content)
    return ChatMessage(role=message.role, content=content or "")


async def chat_completions(request: web.Request) -> web.StreamResponse:
    body = await decode_body(request, ChatRequest)
    params = to_params(body)
    ctx = context_of(request)
    if ctx.card(body.model) is None:
        raise ApiError(404, f"The model {body.model!r} does not exist", param="model", code="model_not_found")
    generation = await start_generation(ctx, body.model, params)
    try:
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return await _stream(request, generation, body.model, include_usage)
        return await _complete(generation, body.model)
    finally:
        await generation.close()


def _envelope(generation: Generation, model: str, kind: str) -> dict:
    return {"id": f"chatcmpl-{generation.command_id}", "object": kind, "created": int(time.time()), "model": model}


def _usage(prompt: int, completion: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


async def _complete(generation: Generation, model: str) -> web.Response:
    text: list[str] = []
    async for chunk in generation.chunks():
        text.append(chunk.text)
        if chunk.finish_reason == "error" or chunk.finish_reason == "cancelled":
            raise ApiError(500 if chunk.finish_reason == "error" else 503, chunk.error or "generation was cancelled")
        if chunk.finish_reason:
            message = {"role": "assistant", "content": "".join(text)}
            body = _envelope(generation, model, "chat.completion") | {
                "choices": [{"index": 0, "message": message, "finish_reason": chunk.finish_reason, "logprobs": None}],
                "usage": _usage(chunk.prompt_tokens, chunk.token_count),
            }
            return web.json_response(body)
    raise ApiError(500, "generation ended without a finish reason")


async def _stream(request: web.Request, generation: Generation, model: str, include_usage: bool) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    envelope = _envelope(generation, model, "chat.completion.chunk")

    async def send(payload: dict | str) -> None:
        data = payload if isinstance(payload, str) else json.dumps(payload)
        await response.write(f"data: {data}\n\n".encode())

    def choice(delta: dict, finish_reason: str | None) -> dict:
        return envelope | {"choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}]}

    await send(choice({"role": "assistant", "content": ""}, None))
    async for chunk in generation.chunks():
        if chunk.text:
            await send(choice({"content": chunk.text}, None))
        if chunk.finish_reason in ("error", "cancelled"):
            await send({"error": {"message": chunk.error or "generation was cancelled", "type": "internal_error"}})
        elif chunk.finish_reason:
            await send(choice({}, chunk.finish_reason))
            if include_usage:
                await send(envelope | {"choices": [], "usage": _usage(chunk.prompt_tokens, chunk.token_count)})
    await send("[DONE]")
    await response.write_eof()
    return response
