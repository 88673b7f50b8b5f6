"""A LoRA adapter's two files (mlx-lm's `adapter_config.json` and `adapters.safetensors`) from a
Hub repository, at one commit, sizes checked before anything is downloaded."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from exo.models.card_facts import HUB_TIMEOUT_S
from exo.models.hub import classify
from exo.models.transfer import DownloadError

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapters.safetensors"
MAX_CONFIG_BYTES = 64 * 1024


class AdapterTooLarge(ValueError):
    pass


@dataclass(frozen=True)
class AdapterDownload:
    config: bytes
    weights: bytes
    commit: str


def hub_adapter(repo_id: str, revision: str, max_bytes: int, endpoint: str | None = None) -> AdapterDownload:
    """Raises DownloadError naming the cause (offline, not_found, gated, unauthorized, network,
    rate_limited, unknown), or AdapterTooLarge."""
    from huggingface_hub import HfApi, hf_hub_download  # here, not at start-up: exo/models/hub.py says why
    from huggingface_hub.hf_api import RepoFile

    api = HfApi(endpoint=endpoint)
    what = f"{repo_id}@{revision}"
    try:
        commit = api.model_info(repo_id, revision=revision, timeout=HUB_TIMEOUT_S).sha or revision
        sizes = {e.path: e.size for e in api.list_repo_tree(repo_id, revision=commit) if isinstance(e, RepoFile)}
        missing = [name for name in (CONFIG_FILE, WEIGHTS_FILE) if name not in sizes]
        if missing:
            raise DownloadError("not_found", f"{repo_id} has no {' or '.join(missing)} at revision {revision!r}: it is "
                                             "not an mlx-lm LoRA adapter (mlx_lm.lora writes both)")
        if sizes[CONFIG_FILE] > MAX_CONFIG_BYTES or sizes[WEIGHTS_FILE] > max_bytes:
            raise AdapterTooLarge(f"{repo_id}: {WEIGHTS_FILE} is {sizes[WEIGHTS_FILE]} bytes; an adapter may have at "
                                  f"most {max_bytes} (EXO_MAX_ADAPTER_BYTES)")
        files = [Path(hf_hub_download(repo_id, name, revision=commit, etag_timeout=HUB_TIMEOUT_S))
                 for name in (CONFIG_FILE, WEIGHTS_FILE)]
        return AdapterDownload(config=files[0].read_bytes(), weights=files[1].read_bytes(), commit=commit)
    except AdapterTooLarge:
        raise
    except Exception as error:  # noqa: BLE001 - classify names every cause; nothing is retried here
        outcome = classify(error, what)
        raise (outcome if isinstance(outcome, DownloadError) else DownloadError(outcome.code, outcome.reason)) from None
