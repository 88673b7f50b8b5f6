"""While this node's NATS is away, a request is answered within seconds with a 503 that names the
cause and when to retry, in its surface's shape, never a 500 after a 30 s publish timeout: a write
(it needs the bus) waits out a short reconnect (RECONNECT_GRACE_S) and no longer; a publish under
a request gives up after REQUEST_PUBLISH_PATIENCE_S (long enough to ride out a stream's leader
election, ~5 s); whatever the broker raises under a handler becomes that 503 here, in one place.
An outage is logged as one WARNING line per cause, at most once a minute with a count, no traceback."""

from __future__ import annotations

import asyncio
import logging
import time

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from exo.api.context import context_of
from exo.api.errors import ApiError
from exo.bus.connection import Connection, disconnected_for
from exo.bus.errors import BROKER_ERRORS
from exo.bus.publish import publish_patience
from exo.bus.readiness import connection_problem

log = logging.getLogger(__name__)

RETRY_AFTER_S = 5
RECONNECT_GRACE_S = 3.0
REQUEST_PUBLISH_PATIENCE_S = 10.0
LOG_EVERY_S = 60.0
_READS = ("GET", "HEAD", "OPTIONS")


def bus_unavailable(cause: str) -> ApiError:
    return ApiError(503, f"the message bus (NATS) is unavailable: {cause}; retry in {RETRY_AFTER_S} s",
                    code="bus_unavailable", headers={"Retry-After": str(RETRY_AFTER_S)})


class _OutageLog:
    """One WARNING line for a cause's first refusal, then at most one a minute with how many there were."""

    def __init__(self) -> None:
        self._said: dict[str, tuple[float, int]] = {}  # cause's kind -> (when last said, refusals since)

    def refused(self, kind: str, cause: str) -> None:
        now = time.monotonic()
        said, unsaid = self._said.get(kind, (float("-inf"), 0))
        if now - said < LOG_EVERY_S:
            self._said[kind] = (said, unsaid + 1)
            return
        self._said[kind] = (now, 0)
        more = f" (and {unsaid} more in the last {LOG_EVERY_S:.0f} s)" if unsaid else ""
        log.warning("answered 503, the message bus is unavailable: %s%s", cause, more)


async def _still_away(nc: Connection) -> str:
    """"" once `nc` is connected; why not, once it has been away RECONNECT_GRACE_S."""
    while (away := disconnected_for(nc)) is not None:
        if away >= RECONNECT_GRACE_S:
            return connection_problem(nc)
        await asyncio.sleep(min(0.05, RECONNECT_GRACE_S - away))
    return ""


def bus_middleware() -> Middleware:
    outages = _OutageLog()

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        nc = context_of(request).nc
        if request.method not in _READS and (cause := await _still_away(nc)):
            outages.refused("disconnected", cause)
            raise bus_unavailable(cause)
        token = publish_patience.set(REQUEST_PUBLISH_PATIENCE_S)
        try:
            return await handler(request)
        except BROKER_ERRORS as error:
            cause = connection_problem(nc) or str(error) or type(error).__name__
            outages.refused(type(error).__name__, cause)
            raise bus_unavailable(cause) from None
        finally:
            publish_patience.reset(token)
    return middleware
