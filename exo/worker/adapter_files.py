"""The LoRA adapters this node's runners load, on disk: each adapter's weights fetched from the
object store exo-adapters by their sha256 (verified, and verified again when taken from the
disk), kept within EXO_ADAPTER_CACHE_BYTES (least recently used out, never one a runner of this
node uses), and a folder per adapter in mlx-lm's layout: its `adapter_config.json`, written from
State, beside a link to the weights.

`<data dir>/adapters/weights/<sha256>` and `<data dir>/adapters/<folder>/`, where the folder is
named by the weights' and the config's hashes together: two adapters with the same weights and
another config (a scale) get folders of their own.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path

from exo.bus.adapters import ADAPTERS, fetch_adapter
from exo.bus.connection import Connection
from exo.core.adapters import Adapter
from exo.worker.image_cache import ImageCache

log = logging.getLogger(__name__)

FETCH_TIMEOUT_S = 600.0  # an adapter of a large model is hundreds of MB
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapters.safetensors"


class AdapterFiles:
    def __init__(self, nc: Connection, directory: Path, limit_bytes: int, in_use: Callable[[], Iterable[str]]) -> None:
        self._nc = nc
        self.directory = directory
        self.weights = ImageCache(directory / "weights", limit_bytes, what="adapter", setting="EXO_ADAPTER_CACHE_BYTES")
        self._in_use = in_use  # digests of the adapters this node's runners use: never evicted
        self._locks: dict[str, asyncio.Lock] = {}

    async def folder_for(self, adapter: Adapter) -> Path:
        """The adapter's folder, its weights fetched first if this node has no good copy. Raises
        BlobUnavailable (missing, corrupt in the store, unreadable) or OSError (e.g. a full disk)."""
        async with self._locks.setdefault(adapter.digest, asyncio.Lock()):  # two runners of one adapter fetch once
            weights = self.weights.path(adapter.digest)
            if adapter.digest in self.weights and await asyncio.to_thread(_hashes_to, weights, adapter.digest):
                self.weights.touch([adapter.digest])
            else:
                data = await fetch_adapter(self._nc, adapter.digest, FETCH_TIMEOUT_S)  # verified against its hash
                await asyncio.to_thread(self.weights.write, adapter.digest, data)
                log.info("worker: adapter %s fetched from %s and verified (%d bytes)", adapter.name, ADAPTERS.name,
                         len(data))
            folder = await asyncio.to_thread(self._write_folder, adapter, weights)
        self.weights.trim(self._in_use())
        return folder

    def _write_folder(self, adapter: Adapter, weights: Path) -> Path:
        key = hashlib.sha256(f"{adapter.digest}\n{adapter.config}".encode()).hexdigest()[:24]
        folder = self.directory / key
        folder.mkdir(parents=True, exist_ok=True)
        _write_whole(folder / CONFIG_FILE, adapter.config.encode())
        link = folder / WEIGHTS_FILE
        if not (link.is_symlink() and os.readlink(link) == str(weights)):
            temporary = folder / f".{uuid.uuid4().hex[:8]}.tmp"
            temporary.symlink_to(weights)
            temporary.replace(link)
        return folder


def _hashes_to(path: Path, digest: str) -> bool:
    """A copy on disk is used only if it still is what its name says (a disk can rot or be edited)."""
    sha = hashlib.sha256()
    try:
        with path.open("rb") as file:
            while chunk := file.read(1 << 20):
                sha.update(chunk)
    except OSError:
        return False
    if sha.hexdigest() != digest:
        log.warning("adapter cache: %s no longer hashes to its name; fetching it again", path)
        return False
    return True


def _write_whole(path: Path, data: bytes) -> None:
    temporary = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        temporary.write_bytes(data)
        temporary.replace(path)
    except OSError:
        temporary.unlink(missing_ok=True)
        raise
