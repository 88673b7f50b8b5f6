"""Cluster routes (exo's names): instances, custom model cards, State, node id, health, model list."""

from __future__ import annotations

import uuid

import msgspec
from aiohttp import web

from exo.api.card_source import complete_card
from exo.api.context import context_of
from exo.api.errors import ApiError
from exo.api.request_body import decode_body
from exo.core.commands import AddCustomCard, DeleteCustomCard, DeleteInstance, PlaceInstance
from exo.core.events import InstanceCreated
from exo.core.state import encode_state
from exo.core.types import ModelCard, Sharding, is_valid_model_id


class PlaceInstanceRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model_id: str
    sharding: Sharding = "pipeline"
    min_nodes: int = 1
    max_queue: int = 0  # open tasks admitted before 429s; 0: the master's default


async def place_instance(request: web.Request) -> web.Response:
    body = await decode_body(request, PlaceInstanceRequest)
    ctx = context_of(request)
    if ctx.card(body.model_id) is None:
        raise ApiError(404, f"unknown model {body.model_id!r}", param="model_id", code="model_not_found")
    if not 0 <= body.max_queue <= 100_000:
        raise ApiError(400, "max_queue must be between 0 (the default) and 100000", param="max_queue")
    command = PlaceInstance(command_id=uuid.uuid4().hex, model_id=body.model_id, sharding=body.sharding,
                            min_nodes=body.min_nodes, max_queue=body.max_queue)
    event = await ctx.outcomes.call(command)
    assert isinstance(event, InstanceCreated)
    return web.json_response({"message": "instance placed", "command_id": command.command_id,
                              "instance_id": event.instance.instance_id, "instance": msgspec.to_builtins(event.instance)})


async def get_instance(request: web.Request) -> web.Response:
    instance = context_of(request).view.state.instances.get(request.match_info["instance_id"])
    if instance is None:
        raise ApiError(404, f"unknown instance {request.match_info['instance_id']!r}")
    return web.json_response(msgspec.to_builtins(instance))


async def delete_instance(request: web.Request) -> web.Response:
    instance_id = request.match_info["instance_id"]
    command = DeleteInstance(command_id=uuid.uuid4().hex, instance_id=instance_id)
    await context_of(request).outcomes.call(command)
    return web.json_response({"message": "instance deleted", "command_id": command.command_id, "instance_id": instance_id})


async def add_model(request: web.Request) -> web.Response:
    raw = await decode_body(request, dict)
    model_id = raw.get("model_id")
    if not isinstance(model_id, str) or not is_valid_model_id(model_id):
        raise ApiError(400, f"model_id must look like 'org/name' without path tricks, got {model_id!r}", param="model_id")
    try:
        card = msgspec.convert(raw, ModelCard)
    except msgspec.ValidationError as error:
        raise ApiError(400, f"invalid model card: {error}") from None
    ctx = context_of(request)
    if model_id in ctx.builtin_cards:
        raise ApiError(409, f"{model_id!r} is a built-in model card", param="model_id")
    card = await complete_card(card)
    await ctx.outcomes.call(AddCustomCard(command_id=uuid.uuid4().hex, card=card))
    return web.json_response({"message": "model card added", "card": msgspec.to_builtins(card)})


async def delete_custom_model(request: web.Request) -> web.Response:
    model_id = request.match_info["model_id"]
    if not is_valid_model_id(model_id):
        raise ApiError(400, f"invalid model id {model_id!r}", param="model_id")
    await context_of(request).outcomes.call(DeleteCustomCard(command_id=uuid.uuid4().hex, model_id=model_id))
    return web.json_response({"message": "model card deleted", "model_id": model_id})


async def list_models(request: web.Request) -> web.Response:
    cards = context_of(request).all_cards()
    data = [{"id": c.model_id, "object": "model", "created": 0, "owned_by": "exo", "name": c.name or c.model_id}
            for c in sorted(cards.values(), key=lambda c: c.model_id)]
    return web.json_response({"object": "list", "data": data})


async def get_state(request: web.Request) -> web.Response:
    return web.Response(body=encode_state(context_of(request).view.state), content_type="application/json")


async def get_node_id(request: web.Request) -> web.Response:
    return web.json_response(context_of(request).node_id)


async def health(request: web.Request) -> web.Response:
    ctx = context_of(request)
    return web.json_response({"status": "ok", "node_id": ctx.node_id, "last_seq": ctx.view.state.last_seq,
                              "nats_connected": ctx.nc.is_connected})
