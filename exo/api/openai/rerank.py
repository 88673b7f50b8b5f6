"""POST /v1/rerank (and /rerank, /v2/rerank, as vLLM serves them), in the shape Jina, Cohere, vLLM
and llama.cpp share: a cross-encoder scores each document against the query (a task like an
embedding's, exo/api/embedding.py: one chunk per document, its score a vector of one float), and the
results come best first, cut to `top_n`. A document is a string or `{"text": ...}`; each comes back
as `{"text": ...}` either way."""

from __future__ import annotations

from typing import Any

import msgspec
from aiohttp import web

from exo.api.context import context_of
from exo.api.embedding import MAX_TEXT_CHARS, run_embeddings
from exo.api.errors import ApiError
from exo.api.keep_alive import keep_alive_seconds
from exo.api.request_body import decode_body
from exo.core.ids import ModelId
from exo.core.requests import EmbedInputs

MAX_DOCUMENTS = 1000  # per request, as Cohere's rerank API recommends at most


class TextDocument(msgspec.Struct, forbid_unknown_fields=True):
    """A document as Jina and Cohere's v1 also send it. Another field (a title) is a 400, not
    ignored: the caller would believe it scored."""

    text: str


class RerankRequest(msgspec.Struct, kw_only=True):
    model: ModelId
    query: str
    documents: list[str | TextDocument]
    top_n: int | None = None  # None: every document
    return_documents: bool = True  # as Jina's and vLLM's (Cohere's default is False)
    keep_alive: str | int | float | None = None  # an extension, as Ollama's (exo/api/keep_alive.py)


def rerank_inputs(body: RerankRequest) -> EmbedInputs:
    """The request checked: 400s naming the field."""
    if not body.query:
        raise ApiError(400, "query must be a non-empty string", param="query")
    if not body.documents:
        raise ApiError(400, "documents must be a non-empty list of strings (or {\"text\": ...} objects)", param="documents")
    if len(body.documents) > MAX_DOCUMENTS:
        raise ApiError(400, f"documents has {len(body.documents)} documents; at most {MAX_DOCUMENTS} in one request",
                       param="documents")
    texts = [d if isinstance(d, str) else d.text for d in body.documents]
    empty = [n for n, text in enumerate(texts) if not text]
    if empty:
        raise ApiError(400, f"documents[{empty[0]}] must be a non-empty string (or {{\"text\": a non-empty string}})",
                       param="documents")
    if (chars := len(body.query) * len(texts) + sum(map(len, texts))) > MAX_TEXT_CHARS:
        raise ApiError(400, f"query and documents have {chars} characters in all (the query counted once per "
                            f"document); at most {MAX_TEXT_CHARS} in one request", param="documents")
    if body.top_n is not None and body.top_n < 1:
        raise ApiError(400, f"top_n must be at least 1, got {body.top_n}", param="top_n")
    return EmbedInputs(texts=texts, query=body.query)


async def rerank(request: web.Request) -> web.Response:
    body = await decode_body(request, RerankRequest)
    inputs = rerank_inputs(body)
    ctx = context_of(request)
    try:
        done = await run_embeddings(ctx, body.model, inputs, keep_alive_s=keep_alive_seconds(body.keep_alive))
    except ApiError as error:
        raise _naming_the_field(error) from None
    if any(len(vector) != 1 for vector in done.vectors):
        raise ApiError(502, "the runner answered vectors, not one score per document: is the model a cross-encoder?")
    scores = [float(vector[0]) for vector in done.vectors]
    ctx.metrics.count_reranked(len(scores))
    results = ranked(scores, inputs.texts, body.top_n, body.return_documents)
    return web.json_response({"id": f"rerank-{done.task_id}", "model": body.model, "results": results,
                              "usage": {"total_tokens": done.prompt_tokens}})


def ranked(scores: list[float], texts: list[str], top_n: int | None, return_documents: bool) -> list[dict[str, Any]]:
    """Best first, cut to top_n; each document as {"text": ...}, however the request sent it."""
    best_first = sorted(range(len(scores)), key=lambda n: -scores[n])[:top_n]
    return [{"index": n, "relevance_score": scores[n], **({"document": {"text": texts[n]}} if return_documents else {})}
            for n in best_first]


def _naming_the_field(error: ApiError) -> ApiError:
    """The runner's too-long refusal names documents[n] or the query; raise_if_failed says messages."""
    if error.code != "context_length_exceeded":
        return error
    param = "query" if error.message.startswith("the query") else "documents"
    return ApiError(error.status, error.message, param=param, code=error.code, headers=error.headers)
