"""Counting every request by route and final status, for /metrics."""

from __future__ import annotations

import asyncio

from aiohttp import web
from aiohttp.typedefs import Handler

from exo.api.context import context_of

CLIENT_CLOSED = 499  # nginx's code for a client that went away before the answer was complete


@web.middleware
async def metrics_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    status = 500
    try:
        response = await handler(request)
        status = response.status
        return response
    except asyncio.CancelledError:
        status = CLIENT_CLOSED
        raise
    except web.HTTPException as error:
        status = error.status
        raise
    finally:
        resource = request.match_info.route.resource
        route = resource.canonical if resource is not None else "unmatched"
        context_of(request).metrics.count_request(request.method, route, status)
