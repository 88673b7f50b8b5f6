"""Responses answers in OpenAI's shapes: output items (an assistant message with output_text,
function_call items), whole or as the typed event stream (response.created ...
response.output_text.delta ... response.function_call_arguments.delta ... response.completed).
Items open as their content arrives, each with its own output_index."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

from aiohttp import web

from exo.api.generation import Generation
from exo.api.sse import SseStream
from exo.core.types import TokenChunk, ToolCall

Send = Callable[[str, dict], Awaitable[None]]


def response_body(command_id: str, echo: dict, status: str, output: list[dict], final: TokenChunk | None = None) -> dict:
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


def _message_item(item_id: str, text: str, status: str) -> dict:
    content = [{"type": "output_text", "text": text, "annotations": []}] if status == "completed" else []
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


def _call_item(item_id: str, call: ToolCall, status: str) -> dict:
    return {"type": "function_call", "id": item_id, "call_id": call.id, "name": call.name,
            "arguments": call.arguments if status == "completed" else "", "status": status}


class Answer:
    """The output items of one response, in order; with `send`, as the events that build them."""

    def __init__(self, command_id: str, send: Send | None = None) -> None:
        self._command_id = command_id
        self._send = send
        self._items: list[dict] = []
        self._text: list[str] | None = None  # the open message item's text, while one is open

    def items(self) -> list[dict]:
        return list(self._items)

    async def text(self, piece: str) -> None:
        if self._text is None:
            await self._open_message()
        assert self._text is not None
        self._text.append(piece)
        await self._emit("response.output_text.delta", self._where() | {"delta": piece})

    def add_text(self, text: str, keep_empty: bool) -> None:
        if text or keep_empty:
            self._items.append(_message_item(f"msg_{self._command_id}", text, "completed"))

    def add_calls(self, calls: list[ToolCall]) -> None:
        for call in calls:
            self._items.append(_call_item(self._call_id(), call, "completed"))

    async def call(self, call: ToolCall) -> None:
        await self._close_message()
        index, item_id = len(self._items), self._call_id()
        self._items.append(_call_item(item_id, call, "completed"))
        where = {"item_id": item_id, "output_index": index}
        await self._emit("response.output_item.added", {"output_index": index, "item": _call_item(item_id, call, "in_progress")})
        await self._emit("response.function_call_arguments.delta", where | {"delta": call.arguments})
        await self._emit("response.function_call_arguments.done", where | {"arguments": call.arguments})
        await self._emit("response.output_item.done", {"output_index": index, "item": self._items[index]})

    async def finish(self) -> None:
        if not self._items and self._text is None:  # nothing at all: one empty message, as a whole answer has
            await self._open_message()
        await self._close_message()

    def _call_id(self) -> str:
        return f"fc_{self._command_id}_{len(self._items)}"

    def _where(self) -> dict:
        return {"item_id": self._items[-1]["id"], "output_index": len(self._items) - 1, "content_index": 0}

    async def _open_message(self) -> None:
        item_id = f"msg_{self._command_id}" + (f"_{len(self._items)}" if self._items else "")
        self._items.append(_message_item(item_id, "", "in_progress"))
        self._text = []
        await self._emit("response.output_item.added", {"output_index": len(self._items) - 1, "item": self._items[-1]})
        await self._emit("response.content_part.added", self._where() | {"part": _part("")})

    async def _close_message(self) -> None:
        if self._text is None:
            return
        whole, self._text = "".join(self._text), None
        self._items[-1] = _message_item(self._items[-1]["id"], whole, "completed")
        await self._emit("response.output_text.done", self._where() | {"text": whole})
        await self._emit("response.content_part.done", self._where() | {"part": _part(whole)})
        await self._emit("response.output_item.done", {"output_index": len(self._items) - 1, "item": self._items[-1]})

    async def _emit(self, kind: str, data: dict) -> None:
        if self._send is not None:
            await self._send(kind, data)


def _part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": []}


async def stream_response(request: web.Request, generation: Generation, echo: dict) -> web.StreamResponse:
    sse = await SseStream.open(request)
    sequence = 0

    async def send(kind: str, data: dict) -> None:
        nonlocal sequence
        await sse.send({"type": kind, "sequence_number": sequence, **data}, event=kind)
        sequence += 1

    command_id = generation.command_id
    answer = Answer(command_id, send)
    await send("response.created", {"response": response_body(command_id, echo, "in_progress", [])})
    await send("response.in_progress", {"response": response_body(command_id, echo, "in_progress", [])})
    async for chunk in generation.chunks():
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
