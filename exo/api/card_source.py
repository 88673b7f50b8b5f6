"""Filling in a custom card from the model's own config.json (local folder or the Hub)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from huggingface_hub import hf_hub_download
from huggingface_hub.errors import EntryNotFoundError, GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

from exo.api.errors import ApiError
from exo.core.catalogue import is_vision_config
from exo.core.types import ModelCard

# The KV cache is kept in the activations' type, which follows the model's (quantized ones included).
_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


async def complete_card(card: ModelCard) -> ModelCard:
    if card.n_layers:
        return card
    config = await asyncio.to_thread(_read_config, card)
    text = config.get("text_config", config)  # multimodal configs nest the language model
    try:
        return ModelCard(**{
            **{f: getattr(card, f) for f in card.__struct_fields__},
            "name": card.name or card.model_id.rsplit("/", 1)[-1],
            "n_layers": int(text.get("num_hidden_layers", 0)),
            "hidden_size": int(text.get("hidden_size", 0)),
            "num_attention_heads": int(text.get("num_attention_heads", 0)),
            "num_key_value_heads": int(text.get("num_key_value_heads", text.get("num_attention_heads", 0))),
            "context_length": int(text.get("max_position_embeddings", 0)),
            "head_dim": int(text.get("head_dim") or 0),
            "kv_dtype_bytes": _DTYPE_BYTES.get(str(text.get("torch_dtype") or text.get("dtype") or ""), 0),
            "supports_images": card.supports_images or is_vision_config(config),
        })
    except (AttributeError, TypeError, ValueError) as error:  # a config.json that is not a model's
        raise ApiError(400, f"{card.source_repo!r} has a config.json exo cannot read: {error}", param="model_id") from None


def _read_config(card: ModelCard) -> dict[str, Any]:
    if card.path:
        path = Path(card.path)
        if not path.is_absolute() or not (path / "config.json").is_file():
            raise ApiError(400, f"path must be an absolute model directory with a config.json: {card.path}", param="path")
        return _parse_config((path / "config.json").read_text(), card.path)
    try:
        downloaded = hf_hub_download(card.source_repo, "config.json", revision=card.revision)
    except (RepositoryNotFoundError, GatedRepoError):
        raise ApiError(404, f"model repository {card.source_repo!r} not found (or it is gated)", param="model_id") from None
    except (RevisionNotFoundError, EntryNotFoundError):
        raise ApiError(404, f"{card.source_repo!r} has no config.json at revision {card.revision!r}", param="model_id") from None
    except Exception as error:  # network and hub failures: tell the caller, keep serving
        raise ApiError(503, f"cannot reach the model hub for {card.source_repo!r}: {error}") from None
    return _parse_config(Path(downloaded).read_text(), card.source_repo)


def _parse_config(text: str, source: str) -> dict[str, Any]:
    try:
        config = json.loads(text)
    except ValueError as error:
        raise ApiError(400, f"{source}: config.json is not valid JSON: {error}", param="model_id") from None
    if not isinstance(config, dict):
        raise ApiError(400, f"{source}: config.json is not a JSON object", param="model_id")
    return config
