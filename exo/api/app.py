"""The aiohttp application: one module per API surface, routes registered here."""

from __future__ import annotations

from aiohttp import web

from exo.api import admin, openai_chat
from exo.api.context import CONTEXT_KEY, ApiContext
from exo.api.errors import error_middleware
from exo.api.request_body import MAX_BODY_BYTES


def build_app(ctx: ApiContext) -> web.Application:
    app = web.Application(middlewares=[error_middleware], client_max_size=MAX_BODY_BYTES)
    app[CONTEXT_KEY] = ctx
    app.router.add_post("/v1/chat/completions", openai_chat.chat_completions)
    app.router.add_get("/v1/models", admin.list_models)
    app.router.add_get("/models", admin.list_models)
    app.router.add_post("/place_instance", admin.place_instance)
    app.router.add_get("/instance/{instance_id}", admin.get_instance)
    app.router.add_delete("/instance/{instance_id}", admin.delete_instance)
    app.router.add_post("/models/add", admin.add_model)
    app.router.add_delete("/models/custom/{model_id:.+}", admin.delete_custom_model)
    app.router.add_get("/state", admin.get_state)
    app.router.add_get("/node_id", admin.get_node_id)
    app.router.add_get("/health", admin.health)
    return app
