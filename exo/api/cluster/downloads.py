"""Download routes: start, cancel or delete a model's download on one node (this one unless the
body or path names another). The node's coordinator answers at once; progress, completion and
failures arrive as events, so `GET /state` (`downloads[node][model]`) and `/events` show them.
"""

from __future__ import annotations

import msgspec
from aiohttp import web

from exo.api.cluster.wire import DownloadBody
from exo.api.context import ApiContext, context_of
from exo.api.errors import ApiError
from exo.api.request_body import decode_body
from exo.bus.peers.download_control import Action, NodeUnreachable, request_download_action
from exo.core.ids import ModelId, NodeId
from exo.core.types import is_valid_model_id

_STATUS = {"not_found": 404, "invalid": 400, "conflict": 409}


async def start(request: web.Request) -> web.Response:
    body = await decode_body(request, DownloadBody)
    ctx = context_of(request)
    ctx.card_or_404(body.model_id)
    return await _ask(ctx, "start", body.node_id or ctx.node_id, body.model_id)


async def cancel(request: web.Request) -> web.Response:
    body = await decode_body(request, DownloadBody)
    ctx = context_of(request)
    return await _ask(ctx, "cancel", body.node_id or ctx.node_id, body.model_id)


async def delete(request: web.Request) -> web.Response:
    ctx = context_of(request)
    return await _ask(ctx, "delete", NodeId(request.match_info["node_id"]), ModelId(request.match_info["model_id"]))


async def list_downloads(request: web.Request) -> web.Response:
    return web.json_response(msgspec.to_builtins(context_of(request).view.state.downloads))


async def _ask(ctx: ApiContext, action: Action, node_id: NodeId, model_id: ModelId) -> web.Response:
    if not is_valid_model_id(model_id):
        raise ApiError(400, f"invalid model id {model_id!r}", param="model_id")
    if node_id not in ctx.view.state.nodes:
        raise ApiError(404, f"unknown node {node_id!r}", param="node_id")
    try:
        reply = await request_download_action(ctx.nc, node_id, action, model_id)
    except NodeUnreachable as error:
        raise ApiError(503, str(error)) from None
    if not reply.ok:
        raise ApiError(_STATUS.get(reply.code, 409), reply.message, code=reply.code or None)
    return web.json_response({"message": reply.message, "node_id": node_id, "model_id": model_id})
