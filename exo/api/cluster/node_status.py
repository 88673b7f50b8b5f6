"""This node's view: its State (GET /state), its id (GET /node_id), whether it can serve (GET /health,
a readiness probe) and whether its process runs (GET /livez, a liveness probe)."""

from __future__ import annotations

import asyncio
import time

from aiohttp import web

from exo.api.context import ApiContext, context_of
from exo.api.errors import ApiError
from exo.bus.cluster_view import ClusterView
from exo.bus.connection import Connection
from exo.bus.errors import BROKER_ERRORS, BusError
from exo.bus.readiness import LagWatch, StreamProbe, connection_problem
from exo.bus.server.jetstream_cluster import event_log_replicas, redundancy
from exo.bus.state_view import FoldedView, StateView
from exo.core.node_names import node_display
from exo.core.state import State, encode_state


async def get_state(request: web.Request) -> web.Response:
    """The cluster's State; `?group=NAME`: a master group's own, as its log folds it (exo/core/groups.py)."""
    group = group_view(request)
    state = context_of(request).view.state if group is None else group.state
    return web.Response(body=encode_state(state), content_type="application/json")


def group_view(request: web.Request) -> StateView | None:
    """The view of the master group `?group=` names (None without it); 404 for one this node does not follow."""
    group = request.query.get("group", "")
    if not group:
        return None
    view = context_of(request).view
    followed = view.groups if isinstance(view, ClusterView) else {}
    if group not in followed:
        raise ApiError(404, f"this node follows no master group {group[:64]!r} (followed: {', '.join(followed) or 'none'})",
                       param="group")
    return followed[group]


async def get_node_id(request: web.Request) -> web.Response:
    return web.json_response(context_of(request).node_id)


class Readiness:
    """What /health keeps between requests: the event stream's cached probe and State's lag watch."""

    def __init__(self, nc: Connection) -> None:
        self._probe = StreamProbe(nc)
        self._lag = LagWatch()
        self._replicas: tuple[float, int] | None = None  # (time.monotonic(), the event log's replicas)

    async def redundancy(self, ctx: ApiContext, ask: bool) -> str:
        """The event log's copies in words; asked of JetStream at most every REPLICAS_CACHE_S (they
        change when nodes join, not per request), and only when `ask` (a bus that serves: a degraded
        /health must answer at once)."""
        if ask and (self._replicas is None or time.monotonic() - self._replicas[0] >= REPLICAS_CACHE_S):
            try:
                replicas = await asyncio.wait_for(event_log_replicas(ctx.nc), REPLICAS_TIMEOUT_S)
            except (TimeoutError, BusError, *BROKER_ERRORS):  # type: ignore[misc]  # a tuple of exception types
                replicas = 0
            self._replicas = (time.monotonic(), replicas)
        return redundancy(self._replicas[1] if self._replicas is not None else 0)

    async def problems(self, ctx: ApiContext) -> list[str]:
        """Why this node cannot serve now, in words; none when it can."""
        found = [connection_problem(ctx.nc)]
        shared = _shared_log(ctx.view)
        if not found[0]:  # the stream is not asked through a connection that is away
            stream = await self._probe.readiness()
            folded = shared.state.last_seq if shared is not None else stream.last_seq
            found += [stream.problem, self._lag.problem(folded, stream.last_seq, time.monotonic())]
        found += [shared.gap if shared is not None else "", ctx.storage_problem() or ""]
        return [problem for problem in found if problem]


READINESS_KEY = web.AppKey("exo_readiness", Readiness)
REPLICAS_CACHE_S = 10.0
REPLICAS_TIMEOUT_S = 1.0


def _shared_log(view: FoldedView) -> StateView | None:
    """The view of the shared event log (EXO_EVENTS) this node folds; None for a stand-in view."""
    if isinstance(view, ClusterView):
        return view.shared
    return view if isinstance(view, StateView) else None


async def health(request: web.Request) -> web.Response:
    """200 "ok" while this node can serve; 503 "degraded" with the reasons in `problem` while it
    cannot (NATS away, the event stream without quorum, State stuck behind it, a full disk). The
    nodes the master marked suspect are named, but this node serves without them."""
    ctx = context_of(request)
    readiness = request.app[READINESS_KEY]
    problems = await readiness.problems(ctx)
    state = ctx.view.state
    body = {"status": "degraded" if problems else "ok", "node_id": ctx.node_id, "last_seq": state.last_seq,
            "redundancy": await readiness.redundancy(ctx, ask=not problems), "nats_connected": ctx.nc.is_connected,
            "suspect_nodes": suspect_names(state)}
    if problems:
        return web.json_response({**body, "problem": "; ".join(problems)}, status=503)
    return web.json_response(body)


def suspect_names(state: State) -> list[str]:
    return sorted(node_display(state, node_id) for node_id, node in state.nodes.items() if node.suspect_since)


async def livez(request: web.Request) -> web.Response:
    """200 while the process runs and answers HTTP; asks nothing of NATS (a liveness probe: failing it
    restarts the process, which a bus outage must not)."""
    return web.json_response({"status": "alive"})
