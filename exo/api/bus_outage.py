"""While this node's NATS is away, a request is answered within seconds with a 503 that names the
cause and when to retry, in its surface's shape, never a 500 after a 30 s publish timeout: a write
(it needs the bus) waits out a short reconnect (RECONNECT_GRACE_S) and no longer; a publish under
a request gives up after REQUEST_PUBLISH_PATIENCE_S (long enough to ride out a stream's leader
election, ~5 s); whatever the broker raises under a handler becomes that 503 here, in one place.
An outage is logged as one WARNING line per cause, at most once a minute with a count, no traceback."""

from __future__ import annotations

import asyncio
import logging

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from exo.api.context import context_of
from exo.api.errors import ApiError
from exo.bus.connection import Connection, disconnected_for
from exo.bus.errors import BROKER_ERRORS
from exo.bus.publish import publish_patience
from exo.bus.readiness import connection_problem
from exo.bus.throttled_log import ThrottledLog

log = logging.getLogger(__name__)

RETRY_AFTER_S = 5
RECONNECT_GRACE_S = 3.0
REQUEST_PUBLISH_PATIENCE_S = 10.0
_REFUSED = "answered 503, the message bus is unavailable: %s"  # per cause's kind, at most a line a minute
_READS = ("GET", "HEAD", "OPTIONS")


def bus_unavailable(cause: str) -> ApiError:
    return ApiError(503, f"the message bus (NATS) is unavailable: {cause}; retry in {RETRY_AFTER_S} s",
                    code="bus_unavailable", headers={"Retry-After": str(RETRY_AFTER_S)})


async def _still_away(nc: Connection) -> str:
    """"" once `nc` is connected; why not, once it has been away RECONNECT_GRACE_S."""
    while (away := disconnected_for(nc)) is not None:
        if away >= RECONNECT_GRACE_S:
            return connection_problem(nc)
        await asyncio.sleep(min(0.05, RECONNECT_GRACE_S - away))
    return ""


def bus_middleware() -> Middleware:
    outages = ThrottledLog(log)

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        nc = context_of(request).nc
        if request.method not in _READS and (cause := await _still_away(nc)):
            outages.warning("disconnected", _REFUSED, cause)
            raise bus_unavailable(cause)
        token = publish_patience.set(REQUEST_PUBLISH_PATIENCE_S)
        try:
            return await handler(request)
        except BROKER_ERRORS as error:
            cause = connection_problem(nc) or str(error) or type(error).__name__
            outages.warning(type(error).__name__, _REFUSED, cause)
            raise bus_unavailable(cause) from None
        finally:
            publish_patience.reset(token)
    return middleware
