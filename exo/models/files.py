"""Which files a node needs, and what each should be: pure functions over plain data.

A model repository is config, tokenizer and template files plus safetensors weights. A node
running layers [start, end) of a model needs every support file and only the weight files
that hold those layers, found from `model.safetensors.index.json` with mlx-lm's own rule
(`mlx_lm.utils.sharded_load`), so what we fetch is exactly what its pipeline loader reads.
"""

from __future__ import annotations

import fnmatch
import re
from typing import Any

import msgspec

from exo.core.manifest import FileMeta as FileMeta  # re-exported: the rest of exo.models imports them from here
from exo.core.manifest import Manifest as Manifest
from exo.core.manifest import decode_manifest as decode_manifest
from exo.core.manifest import encode_manifest as encode_manifest

INDEX_FILE = "model.safetensors.index.json"
WEIGHT_SUFFIX = ".safetensors"
# What mlx-lm needs besides the weights: config, tokenizer and chat templates. No *.py: exo
# never runs a repository's code.
SUPPORT_PATTERNS = ("*.json", "*.jsonl", "*.txt", "*.model", "*.tiktoken", "*.jinja")
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def is_support_file(path: str) -> bool:
    return any(fnmatch.fnmatch(path, pattern) for pattern in SUPPORT_PATTERNS)


def is_weight_file(path: str) -> bool:
    return path.endswith(WEIGHT_SUFFIX)


def layer_files(weight_map: dict[str, str], start: int, end: int) -> set[str]:
    """Weight files holding layers [start, end), plus those holding tensors of no layer
    (embeddings, final norm, head), which every pipeline stage keeps."""
    files: set[str] = set()
    for tensor, file in weight_map.items():
        match = _LAYER.search(tensor)
        if match is None or start <= int(match.group(1)) < end:
            files.add(file)
    return files


def needed_files(paths: list[str], index: dict[str, Any] | None, start: int, end: int) -> list[str]:
    """The files of `paths` a node running layers [start, end) needs, sorted. `end <= start`
    (a shard of unknown size) or no index (one weight file) means every weight file."""
    support = [p for p in paths if is_support_file(p)]
    weights = [p for p in paths if is_weight_file(p)]
    if index is not None and end > start:
        wanted = layer_files(index.get("weight_map", {}), start, end)
        weights = [p for p in weights if p in wanted]
    return sorted({*support, *weights})


def with_verified(manifest: Manifest, path: str, meta: FileMeta) -> Manifest:
    files = {**manifest.files, path: meta}
    return msgspec.structs.replace(manifest, files=files, verified=sorted({*manifest.verified, path}))


def is_safe_path(path: str) -> bool:
    """A relative path that stays inside the model directory (a peer's manifest is not trusted)."""
    parts = path.split("/")
    return bool(path) and not path.startswith("/") and "\\" not in path and all(p not in ("", ".", "..") for p in parts)


def rebase(local: Manifest | None, source: Manifest) -> Manifest:
    """The source's listing (only paths inside the model directory), keeping as verified only
    local files the source still has the same."""
    source = msgspec.structs.replace(source, files={p: m for p, m in source.files.items() if is_safe_path(p)})
    if local is None:
        return msgspec.structs.replace(source, verified=[])
    files = dict(source.files)
    verified = []
    for path in local.verified:
        mine, theirs = local.files.get(path), source.files.get(path)
        if mine is not None and theirs is not None and same_content(mine, theirs):
            files[path] = mine if mine.sha256 else theirs  # keep the sha256 we computed
            verified.append(path)
    return msgspec.structs.replace(source, files=files, verified=sorted(verified))


def same_content(a: FileMeta, b: FileMeta) -> bool:
    if a.size != b.size:
        return False
    if a.sha256 and b.sha256:
        return a.sha256 == b.sha256
    return bool(a.git_oid) and a.git_oid == b.git_oid


def missing(manifest: Manifest, needed: list[str]) -> list[str]:
    verified = set(manifest.verified)
    return [p for p in needed if p not in verified]


