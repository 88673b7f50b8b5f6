"""One download of one model's shard onto this node: where from, into which directory, which
files, and each file from a peer or the Hub, verified, resumed from what is on disk.

The coordinator (exo/worker/downloads.py) runs these one per model and reports their progress;
decisions (which files, which directory, how long to wait) are the pure functions of
exo/models; this module only sequences them.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from exo.bus.connection import Connection
from exo.bus.peers.model_share import PeerError, fetch_from_peer, peer_manifest
from exo.core.ids import NodeId
from exo.core.types import ModelCard
from exo.models.dirs import DownloadSettings, choose_target, free_bytes, read_manifest, write_manifest
from exo.models.files import (
    INDEX_FILE,
    FileMeta,
    Manifest,
    is_support_file,
    is_weight_file,
    missing,
    needed_files,
    rebase,
    with_verified,
)
from exo.models.hub import fetch_from_hub, hub_manifest
from exo.models.transfer import Corrupt, DownloadCancelled, DownloadError, PartialFile

log = logging.getLogger(__name__)


class ModelFetch:
    """Progress (`totals`, `done_of`) is read by the coordinator's reporter while this runs."""

    def __init__(self, nc: Connection, card: ModelCard, start: int, end: int, settings: DownloadSettings,
                 peers: Callable[[], list[NodeId]], slots: asyncio.Semaphore) -> None:
        self._nc = nc
        self._slots = slots  # chunk requests to peers in flight, shared by this node's downloads
        self.card = card
        self.start, self.end = start, end
        self._settings = settings
        self._peers = peers
        self.cancelled = threading.Event()
        self.totals: dict[str, int] = {}  # needed file -> size
        self._done: dict[str, int] = {}  # bytes on disk of files not being transferred right now
        self._active: dict[str, PartialFile] = {}
        self.source = ""
        self.target: Path | None = None
        self.started = False  # true once the files and their sizes are known
        self._manifest: Manifest | None = None
        self._peer: NodeId | None = None
        self._peer_files: set[str] = set()  # what that peer has verified

    def done_of(self) -> dict[str, tuple[int, int]]:
        return {p: (self._active[p].size if p in self._active else self._done.get(p, 0), t) for p, t in self.totals.items()}

    async def run(self) -> Path:
        if self._settings.offline:
            dirs = self._settings.dirs
            raise DownloadError("offline", f"offline mode: {self.card.model_id} is not complete in any model directory "
                                           f"({_dir_list(dirs.writable + dirs.read_only)})")
        source = await self._open_source()
        self.target = await asyncio.to_thread(self._choose_target, source)
        self.target.mkdir(parents=True, exist_ok=True)
        self._manifest = rebase(read_manifest(self.target), source)
        write_manifest(self.target, self._manifest)
        support = [p for p in self._manifest.files if is_support_file(p)]
        self._track(support)
        await self._fetch_all(missing(self._manifest, support))
        needed = needed_files(list(self._manifest.files), self._read_index(), self.start, self.end)
        self._track(needed)
        todo = missing(self._manifest, needed)
        await asyncio.to_thread(self._check_space, todo)
        self.started = True
        await self._fetch_all(todo)
        return self.target

    async def _open_source(self) -> Manifest:
        """A peer that has the model (inside the cluster, at the card's revision), else the Hub."""
        for peer in self._peers() if self._settings.share else []:
            try:
                manifest = await peer_manifest(self._nc, peer, self.card.model_id)
            except PeerError as error:
                log.info("download %s: peer %s cannot serve it (%s)", self.card.model_id, peer, error)
                continue
            same = manifest.repo_id == self.card.source_repo and self.card.revision in (manifest.revision, manifest.commit)
            if same and manifest.verified:
                self.source, self._peer, self._peer_files = f"peer:{peer}", peer, set(manifest.verified)
                return manifest
        self.source = "hub"
        return await asyncio.to_thread(
            hub_manifest, self.card.source_repo, self.card.revision, self._settings.hub_endpoint,
            self._settings.retry, self.cancelled,
        )

    def _choose_target(self, source: Manifest) -> Path:
        support = sum(m.size for p, m in source.files.items() if is_support_file(p))
        weights = [m.size for p, m in source.files.items() if is_weight_file(p)]
        dirs, reserve = self._settings.dirs, self._settings.reserve_bytes
        # The shard's weights are known only once the index is here: try for room for all of
        # them, settle for room for the smallest; the exact check comes before the weights.
        for needed in (support + sum(weights), support + min(weights, default=0)):
            target = choose_target(dirs, self.card.model_id, needed, free_bytes, reserve)
            if target is not None:
                return target
        raise DownloadError("disk_full", f"no model directory has {support + min(weights, default=0)} bytes free "
                                         f"(plus {reserve} kept free) for {self.card.model_id}: {_dir_list(dirs.writable)}")

    def _check_space(self, todo: list[str]) -> None:
        assert self.target is not None and self._manifest is not None
        on_disk = sum(self._done.get(p, 0) for p in todo)
        needed = sum(self._manifest.files[p].size for p in todo) - on_disk
        free = free_bytes(self.target) - self._settings.reserve_bytes
        if needed > free:
            raise DownloadError("disk_full", f"{self.card.model_id} needs {needed} more bytes in {self.target.parent} "
                                             f"but only {max(free, 0)} are free")

    def _read_index(self) -> dict[str, Any] | None:
        assert self.target is not None and self._manifest is not None
        if INDEX_FILE not in self._manifest.verified:
            return None
        index: dict[str, Any] = json.loads((self.target / INDEX_FILE).read_text())  # a JSON object
        return index

    def _track(self, paths: list[str]) -> None:
        """Count the files in the progress, with what is already on disk (verified or partial)."""
        assert self.target is not None and self._manifest is not None
        verified = set(self._manifest.verified)
        for path in paths:
            size = self._manifest.files[path].size
            self.totals[path] = size
            if path in verified:
                self._done[path] = size
            else:
                partial = PartialFile(self.target, path, self._manifest.files[path]).partial
                self._done[path] = min(partial.stat().st_size, size) if partial.exists() else 0

    async def _fetch_all(self, paths: list[str]) -> None:
        gate = asyncio.Semaphore(self._settings.parallel_files)

        async def one(path: str) -> None:
            async with gate:
                meta = await self._fetch_file(path)
            assert self._manifest is not None and self.target is not None
            self._manifest = with_verified(self._manifest, path, meta)
            write_manifest(self.target, self._manifest)

        tasks = [asyncio.ensure_future(one(p)) for p in paths]
        if not tasks:
            return
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        failed = [error for t in tasks if t.done() and (error := t.exception()) is not None]
        if failed:
            # One failure ends the download. The others stop at their next chunk (threads cannot
            # be interrupted) and leave their partial files for the next attempt to resume.
            self.cancelled.set()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise failed[0]

    async def _fetch_file(self, path: str) -> FileMeta:
        assert self._manifest is not None and self.target is not None
        partial = PartialFile(self.target, path, self._manifest.files[path])
        await asyncio.to_thread(partial.open)
        self._active[path] = partial
        try:
            if self._peer is not None and path in self._peer_files:
                try:
                    return await self._from_peer(partial)
                except PeerError as error:
                    log.warning("download %s: %s; falling back to the Hub", self.card.model_id, error)
                    await asyncio.to_thread(partial.open)
            return await asyncio.to_thread(
                fetch_from_hub, self._manifest, partial, self._settings.hub_endpoint, self._settings.retry, self.cancelled,
            )
        finally:
            partial.close()
            self._done[path] = partial.size if not partial.final.exists() else self.totals.get(path, partial.size)
            del self._active[path]

    async def _from_peer(self, partial: PartialFile) -> FileMeta:
        assert self._peer is not None

        async def write(data: bytes) -> None:
            if self.cancelled.is_set():
                raise DownloadCancelled(partial.path)
            await asyncio.to_thread(partial.write, data)

        await fetch_from_peer(self._nc, self._peer, self.card.model_id, partial.path, partial.size,
                              partial.meta.size, write, self._slots)
        try:
            return await asyncio.to_thread(partial.finish)
        except Corrupt as corrupt:
            raise PeerError(f"the copy from node {self._peer} failed verification: {corrupt}") from None


def _dir_list(paths: tuple[Path, ...]) -> str:
    return ", ".join(str(p) for p in paths)
