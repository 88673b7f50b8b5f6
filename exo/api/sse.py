"""Server-sent events: one writer for every surface that streams."""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web


class SseStream:
    def __init__(self, response: web.StreamResponse) -> None:
        self.response = response

    @classmethod
    async def open(cls, request: web.Request) -> SseStream:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                               "X-Accel-Buffering": "no"})
        await response.prepare(request)
        return cls(response)

    async def send(self, data: dict[str, Any] | str, *, event: str | None = None, event_id: str | None = None) -> None:
        lines = []
        if event_id is not None:
            lines.append(f"id: {event_id}")
        if event is not None:
            lines.append(f"event: {event}")
        lines.append(f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}")
        await self.response.write(("\n".join(lines) + "\n\n").encode())

    async def close(self) -> web.StreamResponse:
        await self.response.write_eof()
        return self.response
