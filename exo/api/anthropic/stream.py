"""Anthropic's answer shapes: content blocks (thinking, text, tool_use), stop reasons, usage, and
the streamed events (message_start, content_block_start/delta/stop per block, message_delta,
message_stop). Blocks open as their content arrives: thinking as thinking_delta, text as
text_delta, each tool call as a tool_use block whose input comes as one input_json_delta."""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from exo.api.collect import raise_if_failed
from exo.api.errors import error_body
from exo.api.generation import Generation
from exo.api.sse import SseStream
from exo.api.tool_conversation import arguments_object
from exo.core.requests import TokenChunk, ToolCall


def stop_fields(chunk: TokenChunk, called_tools: bool) -> dict[str, Any]:
    if chunk.finish_reason == "length":
        return {"stop_reason": "max_tokens", "stop_sequence": None}
    if chunk.stop_sequence:
        return {"stop_reason": "stop_sequence", "stop_sequence": chunk.stop_sequence}
    return {"stop_reason": "tool_use" if called_tools else "end_turn", "stop_sequence": None}


def usage(chunk: TokenChunk) -> dict[str, Any]:
    """Anthropic counts prompt tokens read from a cache apart from input_tokens, as we do ours."""
    return {"input_tokens": chunk.prompt_tokens - chunk.cached_tokens, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": chunk.cached_tokens}


def tool_use_block(call: ToolCall) -> dict[str, Any]:
    return {"type": "tool_use", "id": call.id, "name": call.name, "input": arguments_object(call.arguments)}


def content_blocks(text: str, calls: list[ToolCall], reasoning: str = "") -> list[dict[str, Any]]:
    """A whole answer: its thinking, its text (omitted when empty and tools were called), then its tool calls."""
    thinking = [_thinking_block(reasoning)] if reasoning else []
    text_blocks = [{"type": "text", "text": text}] if text or not calls else []
    return [*thinking, *text_blocks, *(tool_use_block(call) for call in calls)]


def _thinking_block(reasoning: str) -> dict[str, Any]:
    # No signature: nothing here is signed, and thinking blocks sent back are dropped (anthropic_messages.py).
    return {"type": "thinking", "thinking": reasoning, "signature": ""}


class _Blocks:
    """The content blocks of a streamed message, each started when its content arrives."""

    def __init__(self, sse: SseStream) -> None:
        self._sse = sse
        self._index = -1
        self._open: str | None = None
        self.called_tools = False

    async def send(self, kind: str, data: dict[str, Any]) -> None:
        await self._sse.send({"type": kind, **data}, event=kind)

    async def thinking(self, piece: str) -> None:
        if self._open != "thinking":
            await self._start(_thinking_block(""))
        await self.send("content_block_delta", {"index": self._index, "delta": {"type": "thinking_delta", "thinking": piece}})

    async def text(self, piece: str) -> None:
        if self._open != "text":
            await self._start({"type": "text", "text": ""})
        await self.send("content_block_delta", {"index": self._index, "delta": {"type": "text_delta", "text": piece}})

    async def tool_call(self, call: ToolCall) -> None:
        await self._start(tool_use_block(call) | {"input": {}})
        partial = json.dumps(arguments_object(call.arguments), ensure_ascii=False)
        await self.send("content_block_delta", {"index": self._index,
                                                "delta": {"type": "input_json_delta", "partial_json": partial}})
        await self._stop()
        self.called_tools = True

    async def finish(self) -> None:
        if self._index < 0:  # no content at all: one empty text block, as a whole answer has
            await self._start({"type": "text", "text": ""})
        await self._stop()

    async def _start(self, block: dict[str, Any]) -> None:
        await self._stop()
        self._index += 1
        self._open = block["type"]
        await self.send("content_block_start", {"index": self._index, "content_block": block})

    async def _stop(self) -> None:
        if self._open is not None:
            await self.send("content_block_stop", {"index": self._index})
            self._open = None


async def stream_message(request: web.Request, generation: Generation, model: str) -> web.StreamResponse:
    chunks = generation.chunks()
    opened: list[SseStream] = []  # early, by the first note that the model is loading

    async def note(text: str) -> None:
        if not opened:
            opened.append(await SseStream.open(request))
        await opened[0].comment(text)

    generation.tell_loading(note)
    first = await anext(chunks)  # message_start reports the prompt's size, known with the first chunk
    if not opened:
        raise_if_failed(first, generation.failure)  # nothing sent yet: a plain error response with its status
    elif first.finish_reason in ("error", "cancelled"):
        await opened[0].send(error_body(500, first.error or "generation was cancelled", path="/v1/messages"),
                             event="error")
        return await opened[0].close()
    sse = opened[0] if opened else await SseStream.open(request)
    blocks = _Blocks(sse)
    await blocks.send("message_start", {"message": {
        "id": f"msg_{generation.command_id}", "type": "message", "role": "assistant", "model": model, "content": [],
        "stop_reason": None, "stop_sequence": None, "usage": usage(first) | {"output_tokens": 0}}})
    await blocks.send("ping", {})
    chunk = first
    while True:
        if chunk.reasoning:
            await blocks.thinking(chunk.reasoning)
        if chunk.text:
            await blocks.text(chunk.text)
        for call in chunk.tool_calls:
            await blocks.tool_call(call)
        if chunk.finish_reason is not None:
            break
        chunk = await anext(chunks)
    await blocks.finish()
    if chunk.finish_reason in ("error", "cancelled"):
        await sse.send(error_body(500, chunk.error or "generation was cancelled", path="/v1/messages"), event="error")
    else:
        await blocks.send("message_delta", {"delta": stop_fields(chunk, blocks.called_tools),
                                            "usage": usage(chunk) | {"output_tokens": chunk.token_count}})
        await blocks.send("message_stop", {})
    return await sse.close()
