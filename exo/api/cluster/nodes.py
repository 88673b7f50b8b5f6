"""POST /nodes/{node}/remove (admin): revoke a node, named by its id, its name or its short id,
with an optional `{"reason": "..."}`. Its instances end (their generations move to other nodes),
it leaves State for good and stops itself (exo/core/revocation.py, docs/deploy.md "Removing a
node"). The answer comes once State has the removal.

404: no such node in State. 409: the name fits several nodes (use the id), or the node is the one
answering this request: it stops once removed, so its caller would be cut off mid-answer and
left without an API; ask another node's API."""

from __future__ import annotations

import time

import msgspec
from aiohttp import web

from exo.api.auth import Grant, current_grant
from exo.api.context import ApiContext, context_of
from exo.api.errors import ApiError
from exo.api.outcomes import new_command_id
from exo.api.request_body import decode_body
from exo.core.commands import RemoveNode
from exo.core.ids import NodeId
from exo.core.node_names import node_display
from exo.core.revocation import find_nodes

MAX_REASON_CHARS = 1000


class RemoveRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    reason: str = ""


async def remove_node(request: web.Request) -> web.Response:
    ctx = context_of(request)
    asked = await decode_body(request, RemoveRequest) if request.can_read_body else RemoveRequest()
    if len(asked.reason) > MAX_REASON_CHARS:
        raise ApiError(400, f"reason is longer than {MAX_REASON_CHARS} characters", param="reason")
    node_id = _the_node(ctx, request.match_info["node"])
    shown = node_display(ctx.view.state, node_id)
    removed_by = f"{_who(current_grant.get(), ctx)} via the API of node {node_display(ctx.view.state, ctx.node_id)}"
    await ctx.outcomes.call(RemoveNode(command_id=new_command_id(), node_id=node_id, reason=asked.reason,
                                       removed_by=removed_by, at=time.time()))
    revoked = ctx.view.state.revoked_nodes.get(node_id)
    return web.json_response({"message": f"node {shown} removed", "node_id": node_id, "name": shown,
                              "public_key": revoked.public_key if revoked else "", "reason": asked.reason,
                              "removed_by": removed_by})


def _the_node(ctx: ApiContext, asked: str) -> NodeId:
    state = ctx.view.state
    found = find_nodes(state, asked)
    if not found:
        gone = state.revoked_nodes.get(NodeId(asked))
        why = f"node {asked} was removed already" if gone else f"unknown node {asked!r} (GET /state lists the nodes)"
        raise ApiError(404, why, param="node")
    if len(found) > 1:
        raise ApiError(409, f"{asked!r} names {len(found)} nodes ({', '.join(found)}): give the node id", param="node",
                       code="conflict")
    if found[0] == ctx.node_id:
        raise ApiError(409, f"node {node_display(state, found[0])} answers this request: once removed it stops, and "
                            "its caller with it; ask another node's API", param="node", code="conflict")
    return found[0]


def _who(grant: Grant, ctx: ApiContext) -> str:
    if grant.key is not None:
        return f"API key {grant.key.key_id}{f' ({grant.key.name})' if grant.key.name else ''}"
    return "an EXO_API_KEYS admin key" if ctx.settings.api_keys or ctx.view.state.api_keys else "an admin (no API keys set)"
