"""This node's view: its State (GET /state), its id (GET /node_id), and whether it is up (GET /health)."""

from __future__ import annotations

from aiohttp import web

from exo.api.context import context_of
from exo.api.errors import ApiError
from exo.bus.cluster_view import ClusterView
from exo.bus.state_view import StateView
from exo.core.state import encode_state


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


async def health(request: web.Request) -> web.Response:
    """200 "ok"; 503 "degraded" with the reason while this node cannot store anything (a full disk)."""
    ctx = context_of(request)
    problem = ctx.storage_problem()
    body = {"status": "degraded" if problem else "ok", "node_id": ctx.node_id, "last_seq": ctx.view.state.last_seq,
            "nats_connected": ctx.nc.is_connected}
    return web.json_response({**body, "problem": problem} if problem else body, status=503 if problem else 200)
