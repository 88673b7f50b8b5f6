"""Getting a model onto this node with huggingface-hub (it honours HF_ENDPOINT, HF_TOKEN and
HF_HUB_OFFLINE). Blocking: callers run it in a thread."""

from __future__ import annotations

from pathlib import Path

from huggingface_hub import snapshot_download

from exo.core.types import ModelCard
from exo.models.cards import card_file_name

COMPLETE_MARKER = ".exo-download-complete"  # holds the revision; a restart then needs no network

# What mlx-lm needs to load a model: weights, config, tokenizer and chat templates.
MODEL_FILE_PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken", "*.jinja"]


def model_dir(card: ModelCard, models_dir: Path) -> Path:
    if card.path:
        return Path(card.path)
    return models_dir / card_file_name(card.model_id).removesuffix(".toml")


def download_model(card: ModelCard, models_dir: Path) -> Path:
    target = model_dir(card, models_dir)
    if card.path:
        if not (target / "config.json").is_file():
            raise FileNotFoundError(f"{card.model_id}: no config.json in local model directory {target}")
        return target
    marker = target / COMPLETE_MARKER
    if marker.is_file() and marker.read_text() == card.revision:
        return target
    snapshot_download(
        repo_id=card.source_repo,
        revision=card.revision,
        local_dir=target,
        allow_patterns=MODEL_FILE_PATTERNS,
    )
    marker.write_text(card.revision)
    return target
