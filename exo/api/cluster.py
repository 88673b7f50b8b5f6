"""More cluster routes: placement previews, cancelling a generation, one model's card."""

from __future__ import annotations

import asyncio

import msgspec
from aiohttp import web

from exo.api.context import context_of
from exo.api.errors import ApiError
from exo.api.generation import cancel_generation
from exo.api.model_list import NOWHERE, availability, openai_entry
from exo.api.validate import check_kv_bits, check_max_context
from exo.core.ids import CommandId, ModelId
from exo.core.placement import human_bytes, node_label, placement_previews
from exo.core.state import State
from exo.core.types import Instance

CANCEL_WAIT_S = 10.0  # how long the cancel route waits to report how the task ended
_ID_PREFIXES = ("chatcmpl-", "cmpl-", "resp_", "msg_")


async def cancel(request: web.Request) -> web.Response:
    """POST /v1/cancel/{command_id}: stop a generation; answers with how its task ended."""
    ctx = context_of(request)
    shown = request.match_info["command_id"]
    for prefix in _ID_PREFIXES:  # the ids the surfaces show, as well as the bare command id
        shown = shown.removeprefix(prefix)
    command_id = CommandId(shown)
    task = ctx.view.state.tasks.get(command_id)
    if task is None:
        raise ApiError(404, f"no generation {command_id!r}", param="command_id")
    if task.status in ("pending", "running"):
        ended = ctx.outcomes.expect_task_end(command_id)
        try:
            await cancel_generation(ctx, command_id)
            await asyncio.wait_for(asyncio.shield(ended), CANCEL_WAIT_S)
        except asyncio.TimeoutError:
            pass  # still ending; the answer says so
        finally:
            ctx.outcomes.forget_task_end(command_id, ended)
    task = ctx.view.state.tasks.get(command_id, task)
    return web.json_response({"message": "cancel requested", "command_id": command_id, "status": task.status,
                              "finish_reason": task.finish_reason})


async def instance_previews(request: web.Request) -> web.Response:
    """GET /instance/previews?model_id=X: each sharding on each node count 1..N, or why not; places nothing."""
    ctx = context_of(request)
    model_id = ModelId(request.query.get("model_id", ""))
    card = ctx.card_or_404(model_id)
    max_context = check_max_context(_query_int(request, "max_context"), card)
    kv_bits = check_kv_bits(_query_int(request, "kv_bits"))
    force = request.query.get("force", "").strip().lower() in ("1", "true", "yes")
    state = ctx.view.state
    previews = []
    for preview in placement_previews(card, state, max_context, kv_bits, force):
        # min_nodes: what to send to POST /place_instance to get this placement.
        shown: dict[str, object] = {"model_id": model_id, "sharding": preview.sharding, "min_nodes": preview.node_count,
                 "node_count": preview.node_count, "max_context": preview.instance.max_context if preview.instance else None}
        if preview.rejection is not None or preview.instance is None:
            assert preview.rejection is not None
            previews.append(shown | {"instance": None, "error": preview.rejection.reason,
                                     "code": preview.rejection.code})
        else:
            previews.append(shown | {"instance": msgspec.to_builtins(preview.instance), "error": None, "code": None,
                                     "ranks": _ranks_shown(preview.instance, state)})
    return web.json_response({"previews": previews})


def _ranks_shown(instance: Instance, state: State) -> list[dict[str, object]]:
    """Per rank, what a person checks before placing: where, which layers, memory for weights and KV cache."""
    ranks: list[dict[str, object]] = []
    for shard in instance.shards:
        node = state.nodes.get(shard.node_id)
        ranks.append({"rank": shard.rank, "node_id": shard.node_id, "node": node_label(node) if node else shard.node_id,
                      "layers": [shard.start_layer, shard.end_layer], "weights_bytes": shard.memory_bytes,
                      "kv_bytes": shard.kv_bytes, "max_context": instance.max_context,
                      "memory": f"{human_bytes(shard.memory_bytes)} weights + {human_bytes(shard.kv_bytes)} KV cache",
                      "free_bytes": node.memory_available if node else 0})
    return ranks


def _query_int(request: web.Request, name: str) -> int:
    try:
        return int(request.query.get(name, "0"))
    except ValueError:
        raise ApiError(400, f"{name} must be a whole number", param=name) from None


async def get_model(request: web.Request) -> web.Response:
    """GET /v1/models/{model_id}: OpenAI's model object, with the card beside it."""
    ctx = context_of(request)
    model_id = ModelId(request.match_info["model_id"])
    card = ctx.require_card(model_id)
    state = ctx.view.state
    where = availability(state).get(card.model_id, NOWHERE)
    return web.json_response({**openai_entry(card, state, where), "card": msgspec.to_builtins(card)})
