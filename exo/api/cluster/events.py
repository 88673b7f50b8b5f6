"""GET /events: the event log as server-sent events, as events are appended.

`?since=SEQ` (or `Last-Event-ID: SEQ` on a reconnect) starts after event SEQ; without it the
stream starts with the next event. Each event's SSE id is its stream sequence and its SSE
event name its wire tag, so `curl -N host/events?since=0` shows the whole history.
`?group=NAME` streams master group NAME's log instead (its own sequences: exo/core/groups.py).
"""

from __future__ import annotations

import asyncio
import logging

from aiohttp import web

from exo.api.cluster.node_status import group_view
from exo.api.context import context_of
from exo.api.errors import ApiError
from exo.api.sse import SseStream
from exo.bus.errors import LogGap
from exo.bus.event_log import EventFollower
from exo.bus.subjects import SHARED, LogNames
from exo.core.event_signers import SignatureCheck
from exo.core.events import AnyEvent, encode_event, event_tag

log = logging.getLogger(__name__)

KEEP_ALIVE_S = 15.0  # a comment line this often keeps idle connections (and proxies) open
_QUEUE_BOUND = 1024  # a slow client holds back its own reader, not the node


async def events(request: web.Request) -> web.StreamResponse:
    ctx = context_of(request)
    names, position = _log_of(request)
    since = _since(request, default=position)
    queue: asyncio.Queue[tuple[int, str, str]] = asyncio.Queue(_QUEUE_BOUND)

    async def on_event(seq: int, event: AnyEvent, verify: SignatureCheck) -> None:
        await queue.put((seq, event_tag(event), encode_event(event).decode()))

    async def on_undecodable(seq: int, reason: str) -> None:
        await queue.put((seq, "undecodable", reason))

    follower = EventFollower(ctx.nc, on_event, on_undecodable, names)
    try:
        await follower.start(since + 1)
    except LogGap as gap:
        raise ApiError(410, str(gap), param="since") from None
    sse: SseStream | None = None
    try:
        sse = await SseStream.open(request)
        while True:
            try:
                seq, tag, data = await asyncio.wait_for(queue.get(), KEEP_ALIVE_S)
            except TimeoutError:
                await sse.comment("keep-alive")
                continue
            await sse.send(data, event=tag, event_id=str(seq))
    except ConnectionError:  # the client went away: how a live feed ends, not an error
        log.debug("events: client %s disconnected", request.remote)
        return sse.response if sse is not None else web.Response(status=400)
    except asyncio.CancelledError:  # the same, seen by aiohttp first (handler_cancellation), or a shutdown
        log.debug("events: the stream to %s was cancelled", request.remote)
        raise
    finally:
        await follower.stop()


def _log_of(request: web.Request) -> tuple[LogNames, int]:
    """The log asked for (the shared one, or `?group=`'s) and this node's position in it."""
    group = group_view(request)
    if group is None:
        return SHARED, context_of(request).view.state.last_seq
    return group.names, group.state.last_seq


def _since(request: web.Request, default: int) -> int:
    raw = request.headers.get("Last-Event-ID") or request.query.get("since")
    if raw is None:
        return default
    try:
        since = int(raw)
    except ValueError:
        raise ApiError(400, f"since must be an event sequence number, got {raw!r}", param="since") from None
    if not 0 <= since < 2**63:  # a stream sequence is an unsigned 64-bit number; nats-server takes 63
        raise ApiError(400, f"since must be between 0 and {2**63 - 1}", param="since")
    return since
