"""What every embeddings surface shares: the input checked, the request run through the cluster as a
task (the runner answers one chunk per input vector), and the vectors back in input order."""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from exo.api.collect import raise_if_failed
from exo.api.context import ApiContext
from exo.api.errors import ApiError
from exo.api.generation import generating
from exo.core.ids import ModelId
from exo.core.requests import EmbedInputs, GenerationParams

if TYPE_CHECKING:
    import numpy as np  # imported where a vector is decoded: not at every node's start

MAX_INPUTS = 2048  # per request, as OpenAI's embeddings API
# A request's inputs go into the log and State with its task: bounded as OpenAI bounds a request
# (300,000 tokens summed over its inputs; four characters a token for text, which is not tokenized here).
MAX_TOKEN_IDS = 300_000
MAX_TEXT_CHARS = 4 * MAX_TOKEN_IDS


@dataclass
class Embeddings:
    vectors: list[np.ndarray]  # float32, in input order (a rerank's: one score each)
    prompt_tokens: int
    task_id: str = ""  # the request's command id


def embed_inputs(value: Any, param: str, dimensions: int | None = None) -> EmbedInputs:
    """A string, a list of strings, a list of token ids or a list of those (OpenAI's `input`)."""
    if dimensions is not None and dimensions < 1:
        raise ApiError(400, f"dimensions must be at least 1, got {dimensions}", param="dimensions")
    items = [value] if isinstance(value, str) or (isinstance(value, list) and value and _is_int(value[0])) else value
    if not isinstance(items, list) or not items:
        raise ApiError(400, f"{param} must be a non-empty string or list (of strings or of token ids)", param=param)
    if len(items) > MAX_INPUTS:
        raise ApiError(400, f"{param} has {len(items)} inputs; at most {MAX_INPUTS} in one request", param=param)
    if all(isinstance(item, str) for item in items):
        empty = [n for n, text in enumerate(items) if not text]
        if empty:
            raise ApiError(400, f"{param}[{empty[0]}] must be a non-empty string", param=param)
        if (chars := sum(map(len, items))) > MAX_TEXT_CHARS:
            raise ApiError(400, f"{param} has {chars} characters in all; at most {MAX_TEXT_CHARS} in one request", param=param)
        return EmbedInputs(texts=items, dimensions=dimensions)
    if all(isinstance(item, list) and item and all(_is_int(t) and t >= 0 for t in item) for item in items):
        if (count := sum(map(len, items))) > MAX_TOKEN_IDS:
            raise ApiError(400, f"{param} has {count} token ids in all; at most {MAX_TOKEN_IDS} in one request", param=param)
        return EmbedInputs(token_ids=items, dimensions=dimensions)
    raise ApiError(400, f"{param} must be strings or lists of token ids (non-negative integers), not a mix", param=param)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_embeds(ctx: ApiContext, model_id: ModelId, dimensions: int | None, rerank: bool = False) -> None:
    """400 for a model whose card does not embed (or rerank, for a rerank), or `dimensions` past its vectors' size."""
    card = ctx.card(model_id)
    if card is None:
        return  # generating() answers the surface's own 404
    reranker = card.embedding is not None and card.embedding.rerank is not None
    if rerank and not reranker:
        raise ApiError(400, f"the model {model_id!r} does not rerank (its card is not a cross-encoder's): use a "
                            "reranker, a BERT sequence classifier with one label", param="model")
    if reranker and not rerank:
        raise ApiError(400, f"the model {model_id!r} is a reranker (a cross-encoder) and does not embed: use "
                            "POST /v1/rerank", param="model")
    if card.embedding is None:
        raise ApiError(400, f"the model {model_id!r} does not embed (its card has no embedding pooling): use an "
                            "embedding model, or POST /v1/chat/completions for this one", param="model")
    if dimensions is not None and card.hidden_size and dimensions > card.hidden_size:
        raise ApiError(400, f"dimensions must be at most {card.hidden_size} for {model_id!r}, got {dimensions}",
                       param="dimensions")


async def run_embeddings(ctx: ApiContext, model_id: ModelId, inputs: EmbedInputs,
                         missing: ApiError | None = None, keep_alive_s: float | None = None) -> Embeddings:
    check_embeds(ctx, model_id, inputs.dimensions, rerank=inputs.query is not None)
    vectors: dict[int, np.ndarray] = {}
    prompt_tokens = 0
    async with generating(ctx, model_id, GenerationParams(embed=inputs), missing, keep_alive_s=keep_alive_s) as generation:
        task_id = generation.command_id
        async for chunk in generation.chunks():
            raise_if_failed(chunk, generation.failure)
            if chunk.embedding:
                vectors[chunk.index] = decoded_vector(chunk.embedding)
            if chunk.finish_reason:
                prompt_tokens = chunk.prompt_tokens
    expected = len(inputs.texts) + len(inputs.token_ids)
    if sorted(vectors) != list(range(expected)):
        raise ApiError(502, f"the runner answered {len(vectors)} vectors for {expected} inputs")
    if len({len(v) for v in vectors.values()}) > 1:
        raise ApiError(502, "the runner answered vectors of different sizes")
    return Embeddings([vectors[n] for n in range(expected)], prompt_tokens, task_id)


def decoded_vector(text: str) -> np.ndarray:
    """A chunk's vector (little-endian float32, base64), checked: anyone with exo's credentials can
    publish on exo.tokens, so what does not decode to finite floats is a 502 naming it, not a 500."""
    import numpy as np

    try:
        raw = base64.b64decode(text, validate=True)
    except ValueError:
        raise ApiError(502, "the runner answered a vector that is not base64") from None
    if not raw or len(raw) % 4:
        raise ApiError(502, f"the runner answered a vector of {len(raw)} bytes, not whole float32s")
    vector = np.frombuffer(raw, dtype="<f4")
    if not np.isfinite(vector).all():
        raise ApiError(502, "the runner answered a vector that is not all finite numbers")
    return vector


def vector_base64(vector: np.ndarray) -> str:
    """OpenAI's encoding_format "base64": the little-endian float32 bytes."""
    return base64.b64encode(vector.astype("<f4").tobytes()).decode()
