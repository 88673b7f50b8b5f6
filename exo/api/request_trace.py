"""A client's W3C `traceparent` header honoured: a request's spans (generating() in generation.py)
join the client's trace instead of starting one. Nothing happens while tracing is off (exo/telemetry)."""

from __future__ import annotations

from aiohttp import web
from aiohttp.typedefs import Handler

from exo.telemetry import tracing


@web.middleware
async def trace_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    if not tracing.enabled():
        return await handler(request)
    with tracing.continued(request.headers.get(tracing.TRACEPARENT, "")):
        return await handler(request)
