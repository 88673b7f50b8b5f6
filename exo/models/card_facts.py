"""What adding a custom card reads from its source: the model's config.json and the size of its
weights, from the Hub (through huggingface-hub) or from a directory. Blocking: callers use threads.

The size is what placement checks memory against: the `*.safetensors` files a node loads (as
downloads count them), never other formats a repository may also carry.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from huggingface_hub import HfApi, hf_hub_download
from huggingface_hub.hf_api import RepoFile

from exo.models.files import is_safe_path, is_weight_file
from exo.models.hub import classify
from exo.models.transfer import DownloadError

# A Hub that does not answer within this is unreachable for an interactive request: say so at once.
HUB_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class CardFacts:
    config_text: str
    weight_bytes: int  # 0: the source lists no weights


def hub_card_facts(repo_id: str, revision: str, endpoint: str | None = None) -> CardFacts:
    """config.json and the weights' size at `revision`. Raises DownloadError naming the cause
    (offline, not_found, gated, unauthorized, network, rate_limited, unknown)."""
    api = HfApi(endpoint=endpoint)
    what = f"{repo_id}@{revision}"
    try:
        commit = api.model_info(repo_id, revision=revision, timeout=HUB_TIMEOUT_S).sha or revision
        files = [e for e in api.list_repo_tree(repo_id, revision=commit, recursive=True) if isinstance(e, RepoFile)]
        if not any(f.path == "config.json" for f in files):
            raise DownloadError("not_found", f"{repo_id} has no config.json at revision {revision!r}: "
                                             "it is not a model exo can run (mlx-lm needs one)")
        config = hf_hub_download(repo_id, "config.json", revision=commit, etag_timeout=HUB_TIMEOUT_S)
        text = Path(config).read_text()
    except Exception as error:  # noqa: BLE001 - classify names every cause; nothing is retried here
        outcome = classify(error, what)
        raise (outcome if isinstance(outcome, DownloadError) else DownloadError(outcome.code, outcome.reason)) from None
    weights = sum(f.size for f in files if is_weight_file(f.path) and is_safe_path(f.path))
    return CardFacts(config_text=text, weight_bytes=weights)


def local_card_facts(path: Path) -> CardFacts:
    """config.json and the weights' size of a model directory (what mlx-lm loads: top-level
    `*.safetensors`; a sparse file counts at its full size, as it loads). Raises OSError."""
    weights = 0
    with os.scandir(path) as entries:
        for entry in entries:
            if is_weight_file(entry.name) and entry.is_file():
                weights += entry.stat().st_size
    return CardFacts(config_text=(path / "config.json").read_text(), weight_bytes=weights)
