"""Filling in a custom card from its source (a local folder or the Hub): the model's shape from
its config.json, and its size from its weights, so placement can check that it fits.

A card given whole (n_layers) without a path is taken as given; one without a size stays of
unknown size, which placement refuses unless forced. Hub failures answer with their cause:
404 only when the Hub said so, 424 in offline mode, 503 when the Hub cannot be reached.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec

from exo.api.errors import ApiError
from exo.bus.connection import redact
from exo.core.catalogue import is_speech_to_text_config, is_text_to_speech_config, is_vision_config
from exo.core.embedding_files import EmbeddingFilesError
from exo.core.types import ModelCard
from exo.models.card_facts import CardFacts, NoWeights, hub_card_facts, local_card_facts
from exo.models.dirs import ModelDirs, find_complete
from exo.models.transfer import DownloadError

# The KV cache is kept in the activations' type, which follows the model's (quantized ones included).
_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
# What each Hub failure is to the caller of /models/add.
HUB_STATUS = {"not_found": 404, "gated": 403, "unauthorized": 403, "offline": 424, "network": 503,
               "rate_limited": 503}


async def complete_card(card: ModelCard, model_dirs: ModelDirs) -> ModelCard:
    if card.n_layers and not card.path:
        return card  # given whole: its size is what it says (0: unknown)
    if card.n_layers and card.storage_bytes:
        return card
    facts = await asyncio.to_thread(_facts, card, model_dirs)
    filled = card if card.n_layers else _with_config(card, _parse_config(facts.config_text, card.path or card.source_repo))
    return msgspec.structs.replace(filled, storage_bytes=filled.storage_bytes or facts.weight_bytes,
                                   embedding=filled.embedding or facts.embedding)


def _with_config(card: ModelCard, config: dict[str, Any]) -> ModelCard:
    text = config.get("text_config", config)  # multimodal configs nest the language model
    try:
        return msgspec.structs.replace(
            card,
            name=card.name or card.model_id.rsplit("/", 1)[-1],
            n_layers=int(text.get("num_hidden_layers", 0)),
            hidden_size=int(text.get("hidden_size", 0)),
            num_attention_heads=int(text.get("num_attention_heads", 0)),
            num_key_value_heads=int(text.get("num_key_value_heads", text.get("num_attention_heads", 0))),
            context_length=int(text.get("max_position_embeddings", 0)),
            head_dim=int(text.get("head_dim") or 0),
            kv_dtype_bytes=_DTYPE_BYTES.get(str(text.get("torch_dtype") or text.get("dtype") or ""), 0),
            supports_images=card.supports_images or is_vision_config(config),
            transcribes=card.transcribes or is_speech_to_text_config(config),
            speaks=card.speaks or is_text_to_speech_config(config),
        )
    except (AttributeError, TypeError, ValueError) as error:  # a config.json that is not a model's
        raise ApiError(400, f"{card.path or card.source_repo!r} has a config.json exo cannot read: {error}",
                       param="path" if card.path else "model_id") from None


def _facts(card: ModelCard, model_dirs: ModelDirs) -> CardFacts:
    if card.path:
        path = Path(card.path)
        if not path.is_absolute() or not (path / "config.json").is_file():
            raise ApiError(400, f"path must be an absolute model directory with a config.json: {card.path}", param="path")
        return _measured(card.path, lambda: local_card_facts(path), "path")
    try:
        return _measured(card.source_repo, lambda: hub_card_facts(card.source_repo, card.revision), "model_id")
    except DownloadError as error:
        local = _local_copy(card, model_dirs)  # offline, or the Hub is down: a copy this node has will do
        if local is not None and error.code in ("offline", "network", "rate_limited"):
            return local
        raise ApiError(HUB_STATUS.get(error.code, 502), _hub_message(card, error), param="model_id",
                       code=f"hub_{error.code}") from None


def _measured(source: str, read: Callable[[], CardFacts], param: str) -> CardFacts:
    try:
        return read()
    except (NoWeights, EmbeddingFilesError) as error:
        raise ApiError(400, f"{source}: {error}", param=param) from None
    except OSError as error:  # unreadable files, the disk gone: name it, keep serving
        raise ApiError(400, f"cannot read the model directory {source}: {error}", param=param) from None


def _local_copy(card: ModelCard, model_dirs: ModelDirs) -> CardFacts | None:
    copy = find_complete(model_dirs, card, 0, 0)
    if copy is None or not (copy.path / "config.json").is_file():
        return None
    try:
        return local_card_facts(copy.path)
    except (OSError, NoWeights, EmbeddingFilesError):
        return None  # not a usable copy: the Hub's error stands


def _hub_message(card: ModelCard, error: DownloadError) -> str:
    repo = card.source_repo
    if error.code == "offline":
        return (f"offline mode: {repo} is not on this node, and exo may not ask the Hub; add it by path "
                f'({{"model_id": "{card.model_id}", "path": "/abs/model/dir"}}), copy it into the model directory, '
                "or start exo without --offline / EXO_OFFLINE")
    if error.code in ("network", "rate_limited"):
        from huggingface_hub import constants  # imported by the failed fetch already

        return (f"cannot reach the model hub ({redact(constants.ENDPOINT)}) for {repo}: {error.reason}; check the network "
                "or HF_ENDPOINT, add the model by path, or retry later")
    return error.reason


def _parse_config(text: str, source: str) -> dict[str, Any]:
    try:
        config = json.loads(text)
    except ValueError as error:
        raise ApiError(400, f"{source}: config.json is not valid JSON: {error}", param="model_id") from None
    if not isinstance(config, dict):
        raise ApiError(400, f"{source}: config.json is not a JSON object", param="model_id")
    return config
