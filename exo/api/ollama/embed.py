"""Ollama's embeddings: POST /api/embed (inputs in, normalized vectors out) and the older
POST /api/embeddings (one prompt, one vector)."""

from __future__ import annotations

import time
from typing import Any

import msgspec
from aiohttp import web

from exo.api.context import context_of
from exo.api.embedding import embed_inputs, run_embeddings
from exo.api.errors import ApiError
from exo.api.keep_alive import keep_alive_seconds
from exo.api.request_body import decode_body
from exo.core.ids import ModelId


class EmbedRequest(msgspec.Struct, kw_only=True):
    model: ModelId
    input: Any = None  # a string or a list of strings
    truncate: bool = True  # accepted; an input past the model's context is a 400 either way
    dimensions: int | None = None
    options: dict[str, Any] | None = None
    keep_alive: str | int | float | None = None


class LegacyEmbeddingsRequest(msgspec.Struct, kw_only=True):
    model: ModelId
    prompt: str = ""
    options: dict[str, Any] | None = None
    keep_alive: str | int | float | None = None


def _missing(model: str) -> ApiError:
    return ApiError(404, f"model '{model}' not found")


async def embed(request: web.Request) -> web.Response:
    body = await decode_body(request, EmbedRequest)
    if isinstance(body.input, list) and not all(isinstance(item, str) for item in body.input):
        raise ApiError(400, "invalid input type: input must be a string or a list of strings", param="input")
    started = time.perf_counter_ns()
    done = await run_embeddings(context_of(request), body.model, embed_inputs(body.input, "input", body.dimensions),
                                _missing(body.model), keep_alive_seconds(body.keep_alive))
    return web.json_response({"model": body.model, "embeddings": [v.tolist() for v in done.vectors],
                              "total_duration": time.perf_counter_ns() - started, "load_duration": 0,
                              "prompt_eval_count": done.prompt_tokens})


async def legacy_embeddings(request: web.Request) -> web.Response:
    body = await decode_body(request, LegacyEmbeddingsRequest)
    done = await run_embeddings(context_of(request), body.model, embed_inputs(body.prompt, "prompt"),
                                _missing(body.model), keep_alive_seconds(body.keep_alive))
    return web.json_response({"embedding": done.vectors[0].tolist()})
