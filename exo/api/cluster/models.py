"""Models: the list (GET /v1/models, GET /models), one card (GET /v1/models/{id}), and custom cards
added or deleted (POST /models/add, DELETE /models/custom/{id}).

The list has every card, built-in and custom, each with where it can be used now. Every card
stays listed, since clients pick models from this list; the extra fields (`ready_on`,
`downloaded_on`: node names; `ready_on_ids`, `downloaded_on_ids`: their ids) tell which are on a
node, and OpenAI clients ignore them."""

from __future__ import annotations

from typing import Any

import msgspec
from aiohttp import web

from exo.api.auth import current_grant
from exo.api.availability import NOWHERE, Availability, availability
from exo.api.card_source import complete_card
from exo.api.context import context_of
from exo.api.errors import ApiError
from exo.api.outcomes import new_command_id
from exo.api.request_body import decode_body, field_hint
from exo.core.commands import AddCustomCard, DeleteCustomCard
from exo.core.ids import ModelId
from exo.core.state import State
from exo.core.types import ModelCard, is_valid_model_id


def openai_entry(card: ModelCard, state: State, where: Availability, model_id: ModelId | None = None) -> dict[str, Any]:
    """`model_id`: "<base>:<adapter>" for an adapter, listed with its base's card (and `parent`, as vLLM lists one)."""
    model_id = model_id or card.model_id
    parent = {"parent": card.model_id} if model_id != card.model_id else {}
    return {"id": model_id, "object": "model", "created": 0, "owned_by": "exo", "name": card.name or card.model_id,
            "context_length": card.context_length, "max_context": state.max_context_of(model_id) or None,
            **parent, **where.fields()}


async def list_models(request: web.Request) -> web.Response:
    ctx = context_of(request)
    state = ctx.view.state
    where = availability(state)
    data = [openai_entry(card, state, where.get(card.model_id, NOWHERE))
            for card in sorted(ctx.all_cards().values(), key=lambda c: c.model_id)]
    data += [openai_entry(card, state, where.get(adapter.model_id, NOWHERE), adapter.model_id)
             for _, adapter in sorted(state.adapters.items())
             if not adapter.deleting and (card := ctx.card(adapter.base_model)) is not None]  # deleting: a 404
    grant = current_grant.get()  # a key sees the models it may use
    data = [entry for entry in data if grant.may_use(entry["id"])]
    return web.json_response({"object": "list", "data": data})


async def get_model(request: web.Request) -> web.Response:
    """GET /v1/models/{model_id}: OpenAI's model object, with the card beside it. A model a key may
    not use is unknown to it, as in the list: its card and where it runs are not that key's to read."""
    ctx = context_of(request)
    model_id = ModelId(request.match_info["model_id"])
    grant = current_grant.get()
    card = ctx.card(model_id)
    if card is None or not grant.may_use(model_id):
        in_scope = [known for known in ctx.all_cards() if grant.may_use(known)]  # nor may the hint name another
        raise ctx.unknown_model(model_id, "model", f"The model {model_id!r} does not exist", in_scope)
    state = ctx.view.state
    where = availability(state).get(model_id, NOWHERE)
    return web.json_response({**openai_entry(card, state, where, model_id), "card": msgspec.to_builtins(card)})


async def add_model(request: web.Request) -> web.Response:
    raw = await decode_body(request, dict)
    model_id = raw.get("model_id")
    if not isinstance(model_id, str) or not is_valid_model_id(model_id) or "/" not in model_id:
        raise ApiError(400, "model_id must look like 'org/name' without path tricks: a Hub repository id such as "
                            "'mlx-community/SmolLM2-135M-Instruct', or e.g. 'local/<name>' with \"path\" for a model "
                            f"directory; got {model_id!r}", param="model_id")
    try:
        card = msgspec.convert(raw, ModelCard)
    except msgspec.ValidationError as error:
        raise ApiError(400, f"invalid model card: {error}{field_hint(str(error), ModelCard)}") from None
    ctx = context_of(request)
    if model_id in ctx.builtin_cards:
        raise ApiError(409, f"{model_id!r} is a built-in model card", param="model_id")
    same = next((known for known in ctx.all_cards() if known.lower() == model_id.lower() and known != model_id), None)
    if same is not None:  # Hub ids ignore case: this would be the same model under a second name
        raise ApiError(409, f"{model_id!r} is already known as {same!r}; use that id", param="model_id")
    _refuse_bad_card(card)
    card = await complete_card(card, ctx.model_dirs)
    _refuse_bad_card(card)
    await ctx.outcomes.call(AddCustomCard(command_id=new_command_id(), card=card))
    return web.json_response({"message": "model card added", "card": msgspec.to_builtins(card)})


def _refuse_bad_card(card: ModelCard) -> None:
    problem = card.problem()
    if problem:
        named = problem.split(" ", 1)[0].split(".", 1)[0].rstrip(",;")
        param = named if named in ModelCard.__struct_fields__ else "model_id"
        raise ApiError(400, f"invalid model card: {problem}", param=param)


async def delete_custom_model(request: web.Request) -> web.Response:
    model_id = ModelId(request.match_info["model_id"])
    if not is_valid_model_id(model_id):
        raise ApiError(400, f"invalid model id {model_id!r}", param="model_id")
    await context_of(request).outcomes.call(DeleteCustomCard(command_id=new_command_id(), model_id=model_id))
    return web.json_response({"message": "model card deleted", "model_id": model_id})
