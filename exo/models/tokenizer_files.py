"""A model's tokenizer without its weights, for an API node that answers token counts without a
runner: its config, tokenizer and chat template files (the support files the worker fetches
first, exo/models/files.py), found in a local copy or fetched once into a cache under the node's
data directory. Blocking: callers run these in threads.

The cache is `<data dir>/tokenizers/<org>--<name>/`, a model directory of support files only,
with the same `.exo-manifest.json` as a download: complete when every support file is verified
at the card's revision. exo/api/tokenizers.py fills it from a peer; `fetch_from_hub_into` from the Hub.
"""

from __future__ import annotations

import threading
from pathlib import Path

from exo.core.types import ModelCard
from exo.models.dirs import ModelDirs, dir_name, read_manifest, write_manifest
from exo.models.files import Manifest, is_support_file, missing, rebase, with_verified
from exo.models.hub import fetch_from_hub, hub_manifest
from exo.models.progress import RetryPolicy
from exo.models.transfer import DownloadError, PartialFile

CACHE_DIR = "tokenizers"
# What says a directory holds a tokenizer mlx-lm can load (with config.json beside it).
TOKENIZER_MARKERS = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "tiktoken.model")
# A request waits for these, so a Hub that keeps failing is reported, not waited out.
API_RETRY = RetryPolicy(attempts=2, max_delay_s=2.0, max_retry_after_s=5.0)


def cache_dir_of(data_dir: Path, card: ModelCard) -> Path:
    return data_dir / CACHE_DIR / dir_name(card.model_id)


def support_files(manifest: Manifest) -> list[str]:
    return sorted(p for p in manifest.files if is_support_file(p))


def find_tokenizer(card: ModelCard, dirs: ModelDirs, cache: Path) -> Path | None:
    """A directory with the card's tokenizer, as the worker would load it: the card's own path, a
    model copy (writable ones by their manifest, read-only ones as found), else the cache."""
    candidates = [Path(card.path)] if card.path else []
    candidates += [*dirs.writable_copies(card.model_id), *dirs.read_only_copies(card), cache]
    return next((path for path in candidates if _has_tokenizer(path, card)), None)


def _has_tokenizer(path: Path, card: ModelCard) -> bool:
    if not path.is_dir():
        return False
    manifest = read_manifest(path)
    if manifest is None:  # a folder as found (the card's path, a read-only copy)
        return (path / "config.json").is_file() and any((path / name).is_file() for name in TOKENIZER_MARKERS)
    at_revision = card.revision in (manifest.revision, manifest.commit)
    return at_revision and not missing(manifest, support_files(manifest)) and (path / "config.json").is_file()


def start_cache(cache: Path, source: Manifest) -> Manifest:
    """The cache's manifest for `source`, keeping the files already verified there."""
    cache.mkdir(parents=True, exist_ok=True)
    manifest = rebase(read_manifest(cache), source)
    write_manifest(cache, manifest)
    return manifest


def fetch_from_hub_into(cache: Path, card: ModelCard, endpoint: str | None, cancelled: threading.Event) -> Path:
    """The card's support files from the Hub (HF_ENDPOINT, HF_TOKEN apply) into `cache`, verified."""
    source = hub_manifest(card.source_repo, card.revision, endpoint, API_RETRY, cancelled)
    manifest = start_cache(cache, source)
    needed = support_files(manifest)
    if "config.json" not in needed:
        raise DownloadError("not_found", f"{card.source_repo}@{card.revision} has no config.json: not a model mlx-lm loads")
    for path in missing(manifest, needed):
        partial = PartialFile(cache, path, manifest.files[path])
        partial.open()
        try:
            meta = fetch_from_hub(manifest, partial, endpoint, API_RETRY, cancelled)
        finally:
            partial.close()
        manifest = with_verified(manifest, path, meta)
        write_manifest(cache, manifest)
    return cache
