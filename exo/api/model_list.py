"""The model list (GET /v1/models, GET /models): every card, built-in and custom, each with where
it can be used now. Every card stays listed, since clients pick models from this list; the extra
fields (`ready_on`, `downloaded_on`) tell which are on a node, and OpenAI clients ignore them."""

from __future__ import annotations

from typing import Any

import msgspec
from aiohttp import web

from exo.api.admin import report_of
from exo.api.context import context_of
from exo.core.ids import ModelId, NodeId
from exo.core.state import State
from exo.core.types import ModelCard


class Availability(msgspec.Struct, frozen=True, kw_only=True):
    """Where a model is now: node ids, sorted."""

    ready_on: list[NodeId] = []  # nodes with a rank of an instance whose every runner is ready
    downloaded_on: list[NodeId] = []  # nodes whose download of the model completed

    def fields(self) -> dict[str, Any]:
        return {"ready_on": list(self.ready_on), "downloaded_on": list(self.downloaded_on)}


NOWHERE = Availability()


def availability(state: State) -> dict[ModelId, Availability]:
    """Every model that is ready or downloaded somewhere; models absent from it are on no node."""
    ready: dict[ModelId, set[NodeId]] = {}
    for instance in state.instances.values():
        if report_of(state, instance).status == "ready":
            ready.setdefault(instance.model_id, set()).update(s.node_id for s in instance.shards)
    downloaded: dict[ModelId, set[NodeId]] = {}
    for node_id, records in state.downloads.items():
        for model_id, record in records.items():
            if record.status == "completed":
                downloaded.setdefault(model_id, set()).add(node_id)
    return {model_id: Availability(ready_on=sorted(ready.get(model_id, ())),
                                   downloaded_on=sorted(downloaded.get(model_id, ())))
            for model_id in ready.keys() | downloaded.keys()}


def openai_entry(card: ModelCard, state: State, where: Availability) -> dict[str, Any]:
    return {"id": card.model_id, "object": "model", "created": 0, "owned_by": "exo", "name": card.name or card.model_id,
            "context_length": card.context_length, "max_context": state.max_context_of(card.model_id) or None,
            **where.fields()}


async def list_models(request: web.Request) -> web.Response:
    ctx = context_of(request)
    state = ctx.view.state
    where = availability(state)
    data = [openai_entry(card, state, where.get(card.model_id, NOWHERE))
            for card in sorted(ctx.all_cards().values(), key=lambda c: c.model_id)]
    return web.json_response({"object": "list", "data": data})
