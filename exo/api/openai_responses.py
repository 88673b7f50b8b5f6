"""POST /v1/responses in OpenAI's shapes: text in, text out, and its typed event stream
(response.created ... response.output_text.delta ... response.completed)."""

from __future__ import annotations

import time

import msgspec
from aiohttp import web

from exo.api.context import context_of
from exo.api.errors import ApiError
from exo.api.generation import Generation, collect, start_generation
from exo.api.request_body import decode_body
from exo.api.sse import SseStream
from exo.api.validate import at_least_one, in_range
from exo.core.types import ChatMessage, GenerationParams, TokenChunk

_ROLES = {"user", "assistant", "system", "developer"}
_TEXT_PARTS = {"input_text", "output_text", "text"}


class ContentPart(msgspec.Struct, kw_only=True):
    type: str
    text: str = ""


class InputItem(msgspec.Struct, kw_only=True):
    role: str = ""
    content: str | list[ContentPart] = ""
    type: str = "message"


class ResponsesRequest(msgspec.Struct, kw_only=True):
    model: str
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    store: bool | None = None
    previous_response_id: str | None = None
    tools: list[dict] | None = None
    metadata: dict | None = None


def _message(n: int, item: InputItem) -> ChatMessage:
    if item.type != "message" or item.role not in _ROLES:
        raise ApiError(400, f"input[{n}] must be a message with role one of {sorted(_ROLES)}", param=f"input[{n}]")
    content = item.content
    if isinstance(content, list):
        if bad := [p.type for p in content if p.type not in _TEXT_PARTS]:
            raise ApiError(400, f"content part type {bad[0]!r} is not supported", param=f"input[{n}].content")
        content = "".join(p.text for p in content)
    return ChatMessage(role=item.role, content=content)


def to_params(body: ResponsesRequest) -> GenerationParams:
    if body.previous_response_id:
        raise ApiError(400, "previous_response_id is not supported: responses are not stored", param="previous_response_id")
    if body.tools:
        raise ApiError(400, "tools are not supported on /v1/responses yet; use /v1/chat/completions", param="tools")
    items = [InputItem(role="user", content=body.input)] if isinstance(body.input, str) else body.input
    if not items:
        raise ApiError(400, "input must not be empty", param="input")
    system = [ChatMessage(role="system", content=body.instructions)] if body.instructions else []
    return GenerationParams(
        messages=[*system, *(_message(n, item) for n, item in enumerate(items))],
        max_tokens=at_least_one(body.max_output_tokens, "max_output_tokens"),
        temperature=in_range(body.temperature, 0.0, 2.0, "temperature"), top_p=in_range(body.top_p, 0.0, 1.0, "top_p"),
    )


async def responses(request: web.Request) -> web.StreamResponse:
    body = await decode_body(request, ResponsesRequest)
    params = to_params(body)
    ctx = context_of(request)
    ctx.require_card(body.model)
    generation = await start_generation(ctx, body.model, params)
    try:
        if body.stream:
            return await _stream(request, generation, body)
        done = await collect(generation)
        assert done.final is not None
        return web.json_response(_response(generation, body, "completed", done.text, done.final))
    finally:
        await generation.close()


def _output_item(generation: Generation, text: str, status: str) -> dict:
    content = [{"type": "output_text", "text": text, "annotations": []}] if status == "completed" else []
    return {"type": "message", "id": f"msg_{generation.command_id}", "status": status, "role": "assistant",
            "content": content}


def _response(generation: Generation, body: ResponsesRequest, status: str, text: str = "",
              final: TokenChunk | None = None) -> dict:
    incomplete = final is not None and final.finish_reason == "length"
    usage = None
    if final is not None:
        usage = {"input_tokens": final.prompt_tokens, "output_tokens": final.token_count,
                 "total_tokens": final.prompt_tokens + final.token_count,
                 "input_tokens_details": {"cached_tokens": final.cached_tokens}, "output_tokens_details": {"reasoning_tokens": 0}}
    return {
        "id": f"resp_{generation.command_id}", "object": "response", "created_at": int(time.time()),
        "status": "incomplete" if incomplete else status, "model": body.model, "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
        "output": [_output_item(generation, text, "completed")] if final is not None else [],
        "parallel_tool_calls": False, "temperature": body.temperature, "top_p": body.top_p,
        "tool_choice": "auto", "tools": [], "usage": usage, "metadata": body.metadata or {},
    }


async def _stream(request: web.Request, generation: Generation, body: ResponsesRequest) -> web.StreamResponse:
    sse = await SseStream.open(request)
    sequence = 0
    item_id = f"msg_{generation.command_id}"

    async def send(kind: str, data: dict) -> None:
        nonlocal sequence
        await sse.send({"type": kind, "sequence_number": sequence, **data}, event=kind)
        sequence += 1

    where = {"item_id": item_id, "output_index": 0, "content_index": 0}
    await send("response.created", {"response": _response(generation, body, "in_progress")})
    await send("response.in_progress", {"response": _response(generation, body, "in_progress")})
    await send("response.output_item.added", {"output_index": 0, "item": _output_item(generation, "", "in_progress")})
    await send("response.content_part.added", where | {"part": {"type": "output_text", "text": "", "annotations": []}})
    text: list[str] = []
    async for chunk in generation.chunks():
        if chunk.text:
            text.append(chunk.text)
            await send("response.output_text.delta", where | {"delta": chunk.text})
        if chunk.finish_reason in ("error", "cancelled"):
            message = chunk.error or "generation was cancelled"
            await send("error", {"code": chunk.finish_reason, "message": message, "param": None})
            await send("response.failed", {"response": _response(generation, body, "failed") | {
                "error": {"code": "server_error", "message": message}}})
        elif chunk.finish_reason:
            whole = "".join(text)
            await send("response.output_text.done", where | {"text": whole})
            await send("response.content_part.done", where | {"part": {"type": "output_text", "text": whole, "annotations": []}})
            await send("response.output_item.done", {"output_index": 0, "item": _output_item(generation, whole, "completed")})
            kind = "response.incomplete" if chunk.finish_reason == "length" else "response.completed"
            await send(kind, {"response": _response(generation, body, "completed", whole, chunk)})
    return await sse.close()
