"""Responses answers in OpenAI's shapes: output items (reasoning with reasoning_text, an assistant
message with output_text, function_call items), whole or as the typed event stream
(response.created ... response.reasoning_text.delta ... response.output_text.delta ...
response.function_call_arguments.delta ... response.completed). Items open as their content
arrives, each with its own output_index."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from exo.api.generation import Generation
from exo.api.sse import SseStream
from exo.core.ids import CommandId
from exo.core.requests import TokenChunk, ToolCall

Send = Callable[[str, dict[str, Any]], Awaitable[None]]


def response_body(command_id: CommandId, echo: dict[str, Any], status: str, output: list[dict[str, Any]],
                  final: TokenChunk | None = None) -> dict[str, Any]:
    incomplete = final is not None and final.finish_reason == "length"
    usage = None
    if final is not None:
        usage = {"input_tokens": final.prompt_tokens, "output_tokens": final.token_count,
                 "total_tokens": final.prompt_tokens + final.token_count,
                 "input_tokens_details": {"cached_tokens": final.cached_tokens}, "output_tokens_details": {"reasoning_tokens": 0}}
    return {
        "id": f"resp_{command_id}", "object": "response", "created_at": int(time.time()),
        "status": "incomplete" if incomplete else status, "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "output": output, "usage": usage, **echo,
    }


def _message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    content = [{"type": "output_text", "text": text, "annotations": []}] if status == "completed" else []
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


def _reasoning_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    content = [{"type": "reasoning_text", "text": text}] if status == "completed" else []
    return {"type": "reasoning", "id": item_id, "summary": [], "content": content, "status": status}


def _call_item(item_id: str, call: ToolCall, status: str) -> dict[str, Any]:
    return {"type": "function_call", "id": item_id, "call_id": call.id, "name": call.name,
            "arguments": call.arguments if status == "completed" else "", "status": status}


_ITEMS = {"message": _message_item, "reasoning": _reasoning_item}


class Answer:
    """The output items of one response, in order; with `send`, as the events that build them."""

    def __init__(self, command_id: CommandId, send: Send | None = None) -> None:
        self._command_id = command_id
        self._send = send
        self._items: list[dict[str, Any]] = []
        self._open: str | None = None  # the kind of the text item still open ("message", "reasoning")
        self._text: list[str] = []  # its text so far

    def items(self) -> list[dict[str, Any]]:
        return list(self._items)

    def add_whole(self, reasoning: str, text: str, calls: list[ToolCall]) -> None:
        """A whole answer's items: its reasoning, its text (empty only when nothing else), its calls."""
        if reasoning:
            self._items.append(_reasoning_item(self._item_id("reasoning"), reasoning, "completed"))
        if text or not calls:
            self._items.append(_message_item(self._item_id("message"), text, "completed"))
        for call in calls:
            self._items.append(_call_item(self._item_id("call"), call, "completed"))

    async def text(self, piece: str) -> None:
        await self._into("message")
        self._text.append(piece)
        await self._emit("response.output_text.delta", self._where() | {"delta": piece})

    async def reasoning(self, piece: str) -> None:
        await self._into("reasoning")
        self._text.append(piece)
        await self._emit("response.reasoning_text.delta", self._where() | {"delta": piece})

    async def call(self, call: ToolCall) -> None:
        await self._close()
        index, item_id = len(self._items), self._item_id("call")
        self._items.append(_call_item(item_id, call, "completed"))
        where = {"item_id": item_id, "output_index": index}
        await self._emit("response.output_item.added", {"output_index": index, "item": _call_item(item_id, call, "in_progress")})
        await self._emit("response.function_call_arguments.delta", where | {"delta": call.arguments})
        await self._emit("response.function_call_arguments.done", where | {"arguments": call.arguments})
        await self._emit("response.output_item.done", {"output_index": index, "item": self._items[index]})

    async def finish(self) -> None:
        if not any(item["type"] != "reasoning" for item in self._items) and self._open != "message":
            await self._into("message")  # no answer at all: one empty message, as a whole answer has
        await self._close()

    def _item_id(self, kind: str) -> str:
        prefix = {"message": "msg", "reasoning": "rs", "call": "fc"}[kind]
        return f"{prefix}_{self._command_id}" + (f"_{len(self._items)}" if self._items else "")

    def _where(self) -> dict[str, Any]:
        return {"item_id": self._items[-1]["id"], "output_index": len(self._items) - 1, "content_index": 0}

    async def _into(self, kind: str) -> None:
        if self._open == kind:
            return
        await self._close()
        self._items.append(_ITEMS[kind](self._item_id(kind), "", "in_progress"))
        self._open, self._text = kind, []
        await self._emit("response.output_item.added", {"output_index": len(self._items) - 1, "item": self._items[-1]})
        if kind == "message":
            await self._emit("response.content_part.added", self._where() | {"part": _part("")})

    async def _close(self) -> None:
        kind, self._open = self._open, None
        if kind is None:
            return
        whole = "".join(self._text)
        self._items[-1] = _ITEMS[kind](self._items[-1]["id"], whole, "completed")
        if kind == "message":
            await self._emit("response.output_text.done", self._where() | {"text": whole})
            await self._emit("response.content_part.done", self._where() | {"part": _part(whole)})
        else:
            await self._emit("response.reasoning_text.done", self._where() | {"text": whole})
        await self._emit("response.output_item.done", {"output_index": len(self._items) - 1, "item": self._items[-1]})

    async def _emit(self, kind: str, data: dict[str, Any]) -> None:
        if self._send is not None:
            await self._send(kind, data)


def _part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": []}


async def stream_response(request: web.Request, generation: Generation, echo: dict[str, Any]) -> web.StreamResponse:
    sse = await SseStream.open(request)
    generation.tell_loading(sse.comment)
    sequence = 0

    async def send(kind: str, data: dict[str, Any]) -> None:
        nonlocal sequence
        await sse.send({"type": kind, "sequence_number": sequence, **data}, event=kind)
        sequence += 1

    command_id = generation.command_id
    answer = Answer(command_id, send)
    await send("response.created", {"response": response_body(command_id, echo, "in_progress", [])})
    await send("response.in_progress", {"response": response_body(command_id, echo, "in_progress", [])})
    async for chunk in generation.chunks():
        if chunk.reasoning:
            await answer.reasoning(chunk.reasoning)
        if chunk.text:
            await answer.text(chunk.text)
        for call in chunk.tool_calls:
            await answer.call(call)
        if chunk.finish_reason in ("error", "cancelled"):
            message = chunk.error or "generation was cancelled"
            await send("error", {"code": chunk.finish_reason, "message": message, "param": None})
            await send("response.failed", {"response": response_body(command_id, echo, "failed", answer.items()) | {
                "error": {"code": "server_error", "message": message}}})
        elif chunk.finish_reason:
            await answer.finish()
            kind = "response.incomplete" if chunk.finish_reason == "length" else "response.completed"
            await send(kind, {"response": response_body(command_id, echo, "completed", answer.items(), chunk)})
    return await sse.close()
