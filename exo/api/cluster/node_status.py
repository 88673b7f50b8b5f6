"""This node's view: its State (GET /state), its id (GET /node_id), whether it can serve (GET /health,
a readiness probe) and whether its process runs (GET /livez, a liveness probe)."""

from __future__ import annotations

import time

from aiohttp import web

from exo.api.context import ApiContext, context_of
from exo.api.errors import ApiError
from exo.bus.cluster_view import ClusterView
from exo.bus.connection import Connection
from exo.bus.readiness import LagWatch, StreamProbe, connection_problem
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
    problems = await request.app[READINESS_KEY].problems(ctx)
    state = ctx.view.state
    body = {"status": "degraded" if problems else "ok", "node_id": ctx.node_id, "last_seq": state.last_seq,
            "nats_connected": ctx.nc.is_connected, "suspect_nodes": suspect_names(state)}
    if problems:
        return web.json_response({**body, "problem": "; ".join(problems)}, status=503)
    return web.json_response(body)


def suspect_names(state: State) -> list[str]:
    return sorted(node_display(state, node_id) for node_id, node in state.nodes.items() if node.suspect_since)


async def livez(request: web.Request) -> web.Response:
    """200 while the process runs and answers HTTP; asks nothing of NATS (a liveness probe: failing it
    restarts the process, which a bus outage must not)."""
    return web.json_response({"status": "alive"})
