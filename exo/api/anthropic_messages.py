"""POST /v1/messages in Anthropic's shapes: system prompt, stop sequences, usage, and the
message_start ... message_stop event stream."""

from __future__ import annotations

import msgspec
from aiohttp import web

from exo.api.context import context_of
from exo.api.errors import ApiError, error_body
from exo.api.generation import Generation, collect, raise_if_failed, start_generation
from exo.api.request_body import decode_body
from exo.api.sse import SseStream
from exo.api.validate import at_least_one, in_range
from exo.core.types import ChatMessage, GenerationParams, TokenChunk


class ContentBlock(msgspec.Struct, kw_only=True):
    type: str
    text: str = ""


class Message(msgspec.Struct, kw_only=True):
    role: str
    content: str | list[ContentBlock]


class MessagesRequest(msgspec.Struct, kw_only=True):
    model: str
    messages: list[Message]
    max_tokens: int
    system: str | list[ContentBlock] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool = False
    metadata: dict | None = None
    tools: list[dict] | None = None


def _text_of(content: str | list[ContentBlock], param: str) -> str:
    if isinstance(content, str):
        return content
    for n, block in enumerate(content):
        if block.type != "text":
            raise ApiError(400, f"content block type {block.type!r} is not supported", param=f"{param}[{n}].type")
    return "".join(block.text for block in content)


def to_params(body: MessagesRequest) -> GenerationParams:
    if not body.messages:
        raise ApiError(400, "messages: at least one message is required", param="messages")
    if body.tools:
        raise ApiError(400, "tools are not supported on /v1/messages yet; use /v1/chat/completions", param="tools")
    messages = [ChatMessage(role="system", content=_text_of(body.system, "system"))] if body.system else []
    for n, message in enumerate(body.messages):
        if message.role not in ("user", "assistant"):
            raise ApiError(400, f"messages[{n}].role must be 'user' or 'assistant'", param=f"messages[{n}].role")
        messages.append(ChatMessage(role=message.role, content=_text_of(message.content, f"messages[{n}].content")))
    return GenerationParams(
        messages=messages, max_tokens=at_least_one(body.max_tokens, "max_tokens"),
        temperature=in_range(body.temperature, 0.0, 1.0, "temperature"), top_p=in_range(body.top_p, 0.0, 1.0, "top_p"),
        top_k=at_least_one(body.top_k, "top_k"), stop=list(body.stop_sequences or []),
    )


async def messages(request: web.Request) -> web.StreamResponse:
    body = await decode_body(request, MessagesRequest)
    params = to_params(body)
    ctx = context_of(request)
    if ctx.card(body.model) is None:
        raise ApiError(404, f"model: {body.model!r} does not exist", param="model")
    generation = await start_generation(ctx, body.model, params)
    try:
        if body.stream:
            return await _stream(request, generation, body.model)
        return await _complete(generation, body.model)
    finally:
        await generation.close()


def _stop(chunk: TokenChunk) -> dict:
    if chunk.finish_reason == "length":
        return {"stop_reason": "max_tokens", "stop_sequence": None}
    if chunk.stop_sequence:
        return {"stop_reason": "stop_sequence", "stop_sequence": chunk.stop_sequence}
    return {"stop_reason": "end_turn", "stop_sequence": None}


def _message(generation: Generation, model: str, content: list[dict], chunk: TokenChunk, output_tokens: int) -> dict:
    return {"id": f"msg_{generation.command_id}", "type": "message", "role": "assistant", "model": model,
            "content": content, "stop_reason": None, "stop_sequence": None,
            "usage": _usage(chunk) | {"output_tokens": output_tokens}}


def _usage(chunk: TokenChunk) -> dict:
    """Anthropic counts prompt tokens read from a cache apart from input_tokens, as we do ours."""
    return {"input_tokens": chunk.prompt_tokens - chunk.cached_tokens, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": chunk.cached_tokens}


async def _complete(generation: Generation, model: str) -> web.Response:
    done = await collect(generation)
    assert done.final is not None
    body = _message(generation, model, [{"type": "text", "text": done.text}], done.final,
                    done.final.token_count) | _stop(done.final)
    return web.json_response(body)


async def _stream(request: web.Request, generation: Generation, model: str) -> web.StreamResponse:
    chunks = generation.chunks()
    first = await anext(chunks)  # message_start reports the prompt's size, known with the first chunk
    raise_if_failed(first)  # nothing sent yet: a plain error response with its status
    sse = await SseStream.open(request)

    async def send(kind: str, data: dict) -> None:
        await sse.send({"type": kind, **data}, event=kind)

    await send("message_start", {"message": _message(generation, model, [], first, 0)})
    await send("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}})
    await send("ping", {})
    chunk = first
    while True:
        if chunk.text:
            await send("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": chunk.text}})
        if chunk.finish_reason is not None:
            break
        chunk = await anext(chunks)
    await send("content_block_stop", {"index": 0})
    if chunk.finish_reason in ("error", "cancelled"):
        await sse.send(error_body(500, chunk.error or "generation was cancelled", path="/v1/messages"), event="error")
    else:
        await send("message_delta", {"delta": _stop(chunk), "usage": _usage(chunk) | {"output_tokens": chunk.token_count}})
        await send("message_stop", {})
    return await sse.close()
