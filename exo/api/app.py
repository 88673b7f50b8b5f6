"""The aiohttp application: one package per API surface (openai/, anthropic/, ollama/, and cluster/
for exo's own routes) over the shared modules beside this one; routes registered here."""

from __future__ import annotations

from aiohttp import web

from exo.api import dashboard
from exo.api.anthropic import count_tokens as anthropic_count_tokens
from exo.api.anthropic import messages as anthropic_messages
from exo.api.auth import auth_middleware
from exo.api.bus_outage import bus_middleware
from exo.api.cluster import (
    adapters,
    cancel,
    downloads,
    events,
    instances,
    join_tokens,
    keys,
    models,
    node_status,
    nodes,
    prometheus,
)
from exo.api.context import CONTEXT_KEY, ApiContext
from exo.api.errors import error_middleware
from exo.api.metrics_history import add_to as add_metrics_history
from exo.api.ollama import embed as ollama_embed
from exo.api.ollama import endpoints as ollama
from exo.api.ollama import models as ollama_models
from exo.api.openai import audio as openai_audio
from exo.api.openai import chat as openai_chat
from exo.api.openai import chat_stream as openai_chat_stream
from exo.api.openai import completions as openai_completions
from exo.api.openai import embeddings as openai_embeddings
from exo.api.openai import rerank as openai_rerank
from exo.api.openai import responses as openai_responses
from exo.api.openai import speech as openai_speech
from exo.api.openai import tokenize as openai_tokenize
from exo.api.rate_headers import add_rate_headers
from exo.api.request_metrics import metrics_middleware
from exo.api.request_trace import trace_middleware
from exo.api.storage import storage_middleware
from exo.api.token_counts import COUNTING_WINDOWS_KEY, CountingWindows
from exo.api.tokenizers import TOKENIZERS_KEY, Tokenizers


def build_app(ctx: ApiContext) -> web.Application:
    # Outermost first: count every answer, then shape errors, then check the key; the bus's trouble innermost.
    app = web.Application(middlewares=[metrics_middleware, trace_middleware, error_middleware, auth_middleware,
                                       storage_middleware, bus_middleware()],
                          client_max_size=ctx.body_limit())  # JSON bodies check it again as they come (request_body.py)
    app[CONTEXT_KEY] = ctx
    app[node_status.READINESS_KEY] = node_status.Readiness(ctx.nc)
    app[TOKENIZERS_KEY] = Tokenizers(ctx)  # the token counting routes', loaded as they are asked for
    app[COUNTING_WINDOWS_KEY] = CountingWindows()  # and their per-key request windows
    app.on_response_prepare.append(add_rate_headers)  # streams too: headers go out before the first event
    _openai(app.router)
    _anthropic_and_ollama(app.router)
    _cluster(app.router)
    dashboard.add_routes(app.router)
    add_metrics_history(app)  # GET /metrics/history and its sampler, for as long as the app runs
    return app


def _openai(router: web.UrlDispatcher) -> None:
    router.add_post("/v1/chat/completions", openai_chat.chat_completions)
    router.add_get("/v1/chat/completions/{id}/stream", openai_chat_stream.resume_chat_route)
    router.add_post("/v1/completions", openai_completions.completions)
    router.add_post("/v1/responses", openai_responses.responses)
    router.add_post("/v1/embeddings", openai_embeddings.embeddings)
    router.add_post("/v1/audio/transcriptions", openai_audio.transcriptions)
    router.add_post("/v1/audio/translations", openai_audio.translations)
    router.add_post("/v1/audio/speech", openai_speech.speech)
    for path in ("/v1/rerank", "/rerank", "/v2/rerank"):  # vLLM's three names for it
        router.add_post(path, openai_rerank.rerank)
    router.add_get("/v1/models", models.list_models)
    router.add_get("/v1/models/{model_id:.+}", models.get_model)
    router.add_get("/models", models.list_models)
    router.add_post("/v1/cancel/{command_id}", cancel.cancel)
    router.add_post("/tokenize", openai_tokenize.tokenize)  # vLLM's and llama.cpp's
    router.add_post("/detokenize", openai_tokenize.detokenize)


def _anthropic_and_ollama(router: web.UrlDispatcher) -> None:
    router.add_post("/v1/messages", anthropic_messages.messages)
    router.add_post("/v1/messages/count_tokens", anthropic_count_tokens.count_tokens)
    router.add_post("/api/chat", ollama.chat)
    router.add_post("/api/generate", ollama.generate)
    router.add_get("/api/tags", ollama.tags)
    router.add_post("/api/show", ollama.show)
    router.add_get("/api/ps", ollama.ps)
    router.add_post("/api/pull", ollama_models.pull)
    router.add_delete("/api/delete", ollama_models.delete)
    router.add_get("/api/version", ollama.version)
    router.add_post("/api/embed", ollama_embed.embed)
    router.add_post("/api/embeddings", ollama_embed.legacy_embeddings)


def _cluster(router: web.UrlDispatcher) -> None:
    router.add_post("/place_instance", instances.place_instance)
    router.add_post("/cluster/join_tokens", join_tokens.create_token)
    router.add_get("/cluster/join_tokens", join_tokens.list_tokens)
    router.add_post("/cluster/join", join_tokens.join)
    router.add_get("/instance/previews", instances.instance_previews)
    router.add_get("/instance/{instance_id}", instances.get_instance)
    router.add_delete("/instance/{instance_id}", instances.delete_instance)
    router.add_get("/desires", instances.list_desires)
    router.add_delete("/desire/{desire_id}", instances.delete_desire)
    router.add_post("/models/add", models.add_model)
    router.add_post("/keys", keys.add_key)
    router.add_get("/keys", keys.list_keys)
    router.add_get("/keys/{key_id}", keys.get_key)
    router.add_patch("/keys/{key_id}", keys.update_key)
    router.add_delete("/keys/{key_id}", keys.delete_key)
    router.add_get("/usage", keys.usage)
    router.add_post("/adapters", adapters.add_adapter)
    router.add_get("/adapters", adapters.list_adapters)
    router.add_get("/adapters/{name}", adapters.get_adapter)
    router.add_delete("/adapters/{name}", adapters.delete_adapter_route)
    router.add_delete("/models/custom/{model_id:.+}", models.delete_custom_model)
    router.add_get("/state", node_status.get_state)
    router.add_get("/events", events.events)
    router.add_get("/node_id", node_status.get_node_id)
    router.add_post("/nodes/{node}/remove", nodes.remove_node)
    router.add_get("/health", node_status.health)
    router.add_get("/livez", node_status.livez)
    router.add_get("/metrics", prometheus.metrics)
    router.add_post("/download/start", downloads.start)
    router.add_post("/download/cancel", downloads.cancel)
    router.add_delete("/download/{node_id}/{model_id:.+}", downloads.delete)
    router.add_get("/downloads", downloads.list_downloads)
