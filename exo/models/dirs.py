"""Where models live on this node: several writable directories, read-only ones, and the
manifest each exo-made model directory keeps.

A writable directory holds `<org>--<name>/` folders written by exo, each with
`.exo-manifest.json` (the source's file listing at one commit, and which files are verified
on disk) and `.exo-partial/` (files being downloaded, resumed from where they stopped).
Read-only directories are used as found and never written or deleted: `<org>--<name>/`,
`<org>/<name>/`, or a Hugging Face cache (`models--<org>--<name>/snapshots/<commit>/`).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from exo.core.ids import ModelId
from exo.core.types import ModelCard, is_valid_model_id
from exo.models.files import (
    INDEX_FILE,
    Manifest,
    decode_manifest,
    encode_manifest,
    is_weight_file,
    layer_files,
    missing,
    needed_files,
)
from exo.models.progress import RetryPolicy
from exo.settings.services import ModelSettings

MANIFEST_FILE = ".exo-manifest.json"
PARTIAL_DIR = ".exo-partial"
LEGACY_MARKER = ".exo-download-complete"  # earlier exo versions: the revision of a full download


def dir_name(model_id: str) -> str:  # a model id or a repo id
    if not is_valid_model_id(model_id):
        raise ValueError(f"invalid model id {model_id!r}")
    return model_id.replace("/", "--")


@dataclass(frozen=True)
class LocalCopy:
    """A model directory that holds everything a shard needs."""

    path: Path
    files: dict[str, int]  # needed file -> size
    writable: bool
    manifest: Manifest | None = None


@dataclass(frozen=True)
class ModelDirs:
    writable: tuple[Path, ...]
    read_only: tuple[Path, ...] = ()

    @classmethod
    def of(cls, settings: ModelSettings, data_dir: Path) -> ModelDirs:
        """EXO_MODELS_DIRS and EXO_MODELS_READ_ONLY_DIRS; with no writable directory given, <data dir>/models."""
        writable = [Path(d).expanduser() for d in settings.models_dirs] or [data_dir / "models"]
        return cls(writable=tuple(writable), read_only=tuple(Path(d).expanduser() for d in settings.models_read_only_dirs))

    def writable_copies(self, model_id: ModelId) -> list[Path]:
        return [d / dir_name(model_id) for d in self.writable if (d / dir_name(model_id)).is_dir()]

    def read_only_copies(self, card: ModelCard) -> list[Path]:
        org, _, name = card.model_id.rpartition("/")
        found = []
        for root in self.read_only:
            layouts = [root / dir_name(card.model_id), root / card.model_id]
            cache = root / f"models--{dir_name(card.source_repo)}"
            ref = cache / "refs" / card.revision
            commit = ref.read_text().strip() if ref.is_file() else card.revision
            layouts.append(cache / "snapshots" / commit)
            found += [p for p in layouts if p.is_dir() and p not in found]
        return found

    def is_read_only(self, path: Path) -> bool:
        resolved = path.resolve()
        return any(resolved.is_relative_to(root.resolve()) for root in self.read_only)


def read_manifest(model_dir: Path) -> Manifest | None:
    path = model_dir / MANIFEST_FILE
    try:
        return decode_manifest(path.read_bytes())
    except (OSError, ValueError):  # absent, or torn by a crash: start from the source again
        return None


def write_manifest(model_dir: Path, manifest: Manifest) -> None:
    temporary = model_dir / f"{MANIFEST_FILE}.tmp"
    temporary.write_bytes(encode_manifest(manifest))
    temporary.replace(model_dir / MANIFEST_FILE)


def find_complete(dirs: ModelDirs, card: ModelCard, start: int, end: int) -> LocalCopy | None:
    """The first directory that holds everything layers [start, end) of `card` need: writable
    ones by their manifest, read-only ones (and earlier exo's marked folders) as found."""
    for path in dirs.writable_copies(card.model_id):
        manifest = read_manifest(path)
        if manifest is not None:
            copy = _complete_by_manifest(path, manifest, card, start, end)
        else:
            marker = path / LEGACY_MARKER
            legacy = marker.is_file() and marker.read_text().strip() == card.revision
            copy = _complete_as_found(path, start, end, writable=True) if legacy else None
        if copy is not None:
            return copy
    for path in dirs.read_only_copies(card):
        manifest = read_manifest(path)
        copy = (_complete_by_manifest(path, manifest, card, start, end) if manifest is not None
                else _complete_as_found(path, start, end, writable=False))
        if copy is not None:
            return LocalCopy(path=copy.path, files=copy.files, writable=False, manifest=copy.manifest)
    return None


def _read_index(path: Path) -> dict[str, Any] | None:
    try:
        index: dict[str, Any] = json.loads((path / INDEX_FILE).read_text())  # a JSON object
        return index
    except (OSError, ValueError):
        return None


def _complete_by_manifest(path: Path, manifest: Manifest, card: ModelCard, start: int, end: int) -> LocalCopy | None:
    if card.revision not in (manifest.revision, manifest.commit):
        return None
    index = _read_index(path) if INDEX_FILE in manifest.verified else None
    if INDEX_FILE in manifest.files and index is None and end > start:
        return None  # cannot tell which weights the shard needs without the index
    needed = needed_files(list(manifest.files), index, start, end)
    if missing(manifest, needed):
        return None
    sizes = {p: manifest.files[p].size for p in needed}
    if any(_size(path / p) != size for p, size in sizes.items()):
        return None  # a verified file was changed or removed behind our back
    return LocalCopy(path=path, files=sizes, writable=True, manifest=manifest)


def _complete_as_found(path: Path, start: int, end: int, writable: bool) -> LocalCopy | None:
    relative = (p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file())
    present = [r for r in relative if not any(part.startswith(".") for part in r.split("/"))]  # no caches, partials
    index = _read_index(path)
    if "config.json" not in present:
        return None
    if index is not None:
        weight_map = index.get("weight_map", {})
        wanted = layer_files(weight_map, start, end) if end > start else set(weight_map.values())
        if not wanted <= set(present):
            return None
    needed = needed_files(present, index, start, end)
    if not any(is_weight_file(p) for p in needed):
        return None
    return LocalCopy(path=path, files={p: _size(path / p) for p in needed}, writable=writable)


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return -1


def choose_target(
    dirs: ModelDirs, model_id: ModelId, needed_bytes: int, free_bytes: Callable[[Path], int], reserve: int = 0
) -> Path | None:
    """Where to download: a writable directory that already holds part of the model (so the
    download resumes), else the first with room for it; None when none has room."""
    existing = dirs.writable_copies(model_id)
    for root in [*(p.parent for p in existing), *dirs.writable]:
        if free_bytes(root) - reserve >= needed_bytes:
            return root / dir_name(model_id)
    return None


def free_bytes(root: Path) -> int:
    probe = root
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent  # the directory may not exist yet: ask its filesystem
    return shutil.disk_usage(probe).free


def delete_copies(dirs: ModelDirs, model_id: ModelId) -> list[Path]:
    """Remove the model from every writable directory (never a read-only one); the removed paths."""
    removed = []
    for path in dirs.writable_copies(model_id):
        if not dirs.is_read_only(path):
            shutil.rmtree(path)
            removed.append(path)
    return removed


@dataclass(frozen=True)
class DownloadSettings:
    dirs: ModelDirs
    offline: bool = False  # only complete local models; nothing from the Hub or peers
    share: bool = True  # serve complete models to peers, and fetch from peers before the Hub
    reserve_bytes: int = 0  # free space to leave on the disk a download goes to
    progress_interval_s: float = 1.0
    parallel_files: int = 4
    hub_endpoint: str | None = None  # None: huggingface_hub's (HF_ENDPOINT)
    retry: RetryPolicy = RetryPolicy()

    @classmethod
    def of(cls, settings: ModelSettings, data_dir: Path) -> DownloadSettings:
        return cls(dirs=ModelDirs.of(settings, data_dir), offline=settings.offline, share=settings.model_sharing,
                   reserve_bytes=settings.models_reserve_bytes, retry=RetryPolicy(attempts=settings.download_retries))
