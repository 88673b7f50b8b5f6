"""The images this node's tasks need: fetched from the object store by their sha256 (verified),
kept on disk within EXO_IMAGE_CACHE_BYTES (exo/worker/image_cache.py), the ones open tasks need
kept. What to fetch and what is needed is the planner's (exo/worker/plan.py); this is the I/O."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable
from pathlib import Path

from exo.bus.connection import Connection
from exo.bus.images import ImageUnavailable, fetch_image
from exo.worker.image_cache import ImageCache

log = logging.getLogger(__name__)


class TaskImages:
    def __init__(self, *, nc: Connection, images_dir: Path, fail_tasks_needing: Callable[[str, str], None],
                 needed: Callable[[], Iterable[str]], limit_bytes: int) -> None:
        self._nc = nc
        self.cache = ImageCache(images_dir, limit_bytes)  # what is on disk: plan's local_images
        self.in_flight: set[str] = set()
        self._fail_tasks_needing = fail_tasks_needing  # (digest, reason): an image that cannot be had fails its tasks
        self._needed = needed  # what the open tasks need, listed only when something must go

    async def fetch(self, digests: list[str]) -> None:
        for digest in digests:
            try:
                await self._fetch_one(digest)
            finally:  # in flight until it is on disk (or failed): a plan meanwhile must not fetch it again
                self.in_flight.discard(digest)

    async def fetch_while_room(self, digests: list[str]) -> None:
        """Fetch images no task of this node needs yet (a late joiner's guess at its coming work),
        while the cache has room: they must never push out what is needed."""
        for digest in digests:
            if self.cache.total_bytes >= self.cache.limit_bytes:
                return
            await self.fetch([digest])

    async def _fetch_one(self, digest: str) -> None:
        try:
            data = await fetch_image(self._nc, digest)  # verified against its hash
        except ImageUnavailable as error:  # missing, corrupt or unreadable: its tasks fail
            log.error("worker: %s", error)
            self._fail_tasks_needing(digest, str(error))
            return
        try:
            await asyncio.to_thread(self.cache.write, digest, data)
        except OSError as error:  # a full disk: its tasks fail
            log.error("cannot store image %s: %s", digest, error)
            self._fail_tasks_needing(digest, f"cannot store the image: {error}")
            return
        log.info("worker: image %s fetched and verified (%d bytes)", digest, len(data))
        self.trim()

    def trim(self) -> None:
        """Keep the image folder within its bound; what the open tasks need stays. It runs on every
        wake of the worker: what the tasks need is listed only when something must go."""
        over = self.cache.total_bytes > self.cache.limit_bytes
        self.cache.trim(self._needed() if over else ())
