"""What adding a custom card reads from its source: the model's config.json and the size of its
weights, from the Hub (through huggingface-hub) or from a directory. Blocking: callers use threads.

The size is what placement checks memory against, counted by mlx-lm's own rule for what it
loads: the files `model.safetensors.index.json` maps tensors to, else the top-level
`model*.safetensors` (a repository's other copies, e.g. `consolidated.safetensors` or
`original/`, are never loaded, so never counted).
"""

from __future__ import annotations

import fnmatch
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from exo.core.embedding_files import EmbeddingFilesError, embedding_of
from exo.core.types import EmbeddingSpec
from exo.models.files import INDEX_FILE, is_safe_path
from exo.models.hub import classify
from exo.models.transfer import DownloadError

# A Hub that does not answer within this is unreachable for an interactive request: say so at once.
HUB_TIMEOUT_S = 10.0
_SINGLE_FILES = "model*.safetensors"  # what mlx-lm globs when there is no index
MAX_META_FILE_BYTES = 64 << 20  # config.json and the index: a few MB for the largest models


class NoWeights(Exception):
    """The source has no safetensors weights mlx-lm would load, or its config or index is not a model's."""


@dataclass(frozen=True)
class CardFacts:
    config_text: str
    weight_bytes: int
    embedding: EmbeddingSpec | None = None  # from sentence-transformers' files: the model embeds


def weight_bytes(sizes: Mapping[str, int], index_text: str | None) -> int:
    """The bytes mlx-lm loads, from the files' sizes (relative path -> bytes) and the index, if any."""
    if index_text is not None:
        try:
            weight_map = json.loads(index_text)["weight_map"]
        except (ValueError, TypeError, KeyError):
            weight_map = None
        # A repository's file: anything may be in it. Only tensor name -> file name is an index.
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            raise NoWeights(f"{INDEX_FILE} is not a valid index (a weight_map of tensor names to file names)")
        loaded = [path for path in set(weight_map.values()) if path in sizes and is_safe_path(path)]
    else:
        loaded = [path for path in sizes if "/" not in path and fnmatch.fnmatch(path, _SINGLE_FILES)]
    if not loaded:
        raise NoWeights("no safetensors weights mlx-lm would load (model*.safetensors, or the files "
                        f"{INDEX_FILE} names); mlx-lm loads no other format: convert it with mlx_lm.convert")
    return sum(sizes[path] for path in loaded)


def hub_card_facts(repo_id: str, revision: str, endpoint: str | None = None) -> CardFacts:
    """config.json and the weights' size at `revision`. Raises DownloadError naming the cause
    (offline, not_found, gated, unauthorized, network, rate_limited, unknown), or NoWeights."""
    from huggingface_hub import HfApi  # here, not at start-up: exo/models/hub.py says why
    from huggingface_hub.hf_api import RepoFile

    api = HfApi(endpoint=endpoint)
    what = f"{repo_id}@{revision}"
    try:
        commit = api.model_info(repo_id, revision=revision, timeout=HUB_TIMEOUT_S).sha or revision
        files = {e.path: e.size for e in api.list_repo_tree(repo_id, revision=commit, recursive=True)
                 if isinstance(e, RepoFile)}
        if "config.json" not in files:
            raise DownloadError("not_found", f"{repo_id} has no config.json at revision {revision!r}: "
                                             "it is not a model exo can run (mlx-lm needs one)")
        text = _hub_text(repo_id, "config.json", commit)
        index = _hub_text(repo_id, INDEX_FILE, commit) if INDEX_FILE in files else None
        embedding = embedding_of(lambda name: _hub_text(repo_id, name, commit) if name in files else None)
    except (NoWeights, EmbeddingFilesError):
        raise
    except Exception as error:  # noqa: BLE001 - classify names every cause; nothing is retried here
        outcome = classify(error, what)
        raise (outcome if isinstance(outcome, DownloadError) else DownloadError(outcome.code, outcome.reason)) from None
    return CardFacts(config_text=text, weight_bytes=weight_bytes(files, index), embedding=embedding)


def _hub_text(repo_id: str, filename: str, commit: str) -> str:
    from huggingface_hub import hf_hub_download

    return small_text(Path(hf_hub_download(repo_id, filename, revision=commit, etag_timeout=HUB_TIMEOUT_S)))


def small_text(path: Path) -> str:
    """A config or index file's text; one far larger than any real one is refused, not read into memory."""
    if path.stat().st_size > MAX_META_FILE_BYTES:
        raise NoWeights(f"{path.name} is {path.stat().st_size} bytes: not a model's (at most {MAX_META_FILE_BYTES})")
    return path.read_text()


def local_card_facts(path: Path) -> CardFacts:
    """config.json and the weights' size of a model directory (a sparse file counts at its full
    size, as it loads). Raises OSError or NoWeights."""
    with os.scandir(path) as entries:
        sizes = {entry.name: entry.stat().st_size for entry in entries if entry.is_file()}
    index = small_text(path / INDEX_FILE) if INDEX_FILE in sizes else None
    embedding = embedding_of(lambda name: small_text(path / name) if (path / name).is_file() else None)
    return CardFacts(config_text=small_text(path / "config.json"), weight_bytes=weight_bytes(sizes, index),
                     embedding=embedding)

