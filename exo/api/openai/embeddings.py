"""POST /v1/embeddings in OpenAI's shapes: one vector per input, as floats or base64."""

from __future__ import annotations

from typing import Any, Literal

import msgspec
from aiohttp import web

from exo.api.context import context_of
from exo.api.embedding import embed_inputs, run_embeddings, vector_base64
from exo.api.keep_alive import keep_alive_seconds
from exo.api.request_body import decode_body
from exo.core.ids import ModelId


class EmbeddingRequest(msgspec.Struct, kw_only=True):
    model: ModelId
    input: Any  # a string, strings, token ids, or lists of token ids: checked by embed_inputs
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None  # accepted, as OpenAI's; not used
    keep_alive: str | int | float | None = None  # an extension, as Ollama's (exo/api/keep_alive.py)


async def embeddings(request: web.Request) -> web.Response:
    body = await decode_body(request, EmbeddingRequest)
    inputs = embed_inputs(body.input, "input", body.dimensions)
    done = await run_embeddings(context_of(request), body.model, inputs, keep_alive_s=keep_alive_seconds(body.keep_alive))
    data = [{"object": "embedding", "index": n,
             "embedding": vector_base64(vector) if body.encoding_format == "base64" else vector.tolist()}
            for n, vector in enumerate(done.vectors)]
    return web.json_response({"object": "list", "data": data, "model": body.model,
                              "usage": {"prompt_tokens": done.prompt_tokens, "total_tokens": done.prompt_tokens}})
