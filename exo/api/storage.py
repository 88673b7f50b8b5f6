"""While this node's NATS cannot store anything (its embedded server's disk is full), every request
that would write (a chat, a card, a placement) is answered at once with a 507 that names the cause
and when to retry, instead of a 500 after the publish times out. Reads go on: State is in memory."""

from __future__ import annotations

from aiohttp import web
from aiohttp.typedefs import Handler

from exo.api.context import context_of
from exo.api.errors import ApiError

RETRY_AFTER_S = 5
_READS = ("GET", "HEAD", "OPTIONS")


@web.middleware
async def storage_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    if request.method not in _READS and (problem := context_of(request).storage_problem()):
        raise ApiError(507, problem, code="insufficient_storage", headers={"Retry-After": str(RETRY_AFTER_S)})
    return await handler(request)
