"""The worker's images on disk (`<data dir>/images/<sha256>`), bounded in bytes.

Least recently used first out ("used" = fetched, or handed to a runner with a task), but never
a file that a task of this node still needs: the caller passes that set in (plan.images_needed).
If the needed files alone are over the limit they all stay, and that is logged. The order
survives a restart through the files' mtimes (a use touches the file).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import uuid
from collections import OrderedDict
from collections.abc import Iterable
from pathlib import Path

log = logging.getLogger(__name__)


_DIGEST = re.compile(r"[0-9a-f]{64}")


class ImageCache:
    def __init__(self, directory: Path, limit_bytes: int, what: str = "image", setting: str = "EXO_IMAGE_CACHE_BYTES") -> None:
        self.directory = directory
        self._what, self._setting = what, setting  # for its log lines: the adapters' weights use it too
        self.limit_bytes = limit_bytes
        self._sizes: OrderedDict[str, int] = OrderedDict()  # least recently used first
        self._total = 0
        self._over_logged = False
        self._scan()

    def _scan(self) -> None:
        """What an earlier run left: its images, oldest use first; half-written files go."""
        if not self.directory.is_dir():
            return
        found: list[tuple[float, str, int]] = []
        for path in self.directory.iterdir():
            try:
                if path.name.startswith(".") and path.name.endswith(".tmp"):
                    path.unlink(missing_ok=True)  # an interrupted write
                elif _DIGEST.fullmatch(path.name) and path.is_file():
                    stat = path.stat()
                    found.append((stat.st_mtime, path.name, stat.st_size))
            except OSError as error:
                log.warning("%s cache: cannot read %s: %s", self._what, path, error)
        for _, digest, size in sorted(found):
            self.add(digest, size)

    def __contains__(self, digest: object) -> bool:
        return digest in self._sizes

    def digests(self) -> frozenset[str]:
        return frozenset(self._sizes)

    def order(self) -> list[str]:
        """Least recently used first."""
        return list(self._sizes)

    @property
    def total_bytes(self) -> int:
        return self._total

    def path(self, digest: str) -> Path:
        return self.directory / digest

    def add(self, digest: str, size: int) -> None:
        """A file just written to `path(digest)`: the most recently used."""
        self._total += size - self._sizes.get(digest, 0)
        self._sizes[digest] = size
        self._sizes.move_to_end(digest)

    def write(self, digest: str, data: bytes) -> None:
        """Store verified bytes under their digest, whole or not at all (raises OSError, e.g. a full
        disk, with no half-written file left behind); then they are the most recently used."""
        self.directory.mkdir(parents=True, exist_ok=True)
        temporary = self.directory / f".{digest}.{uuid.uuid4().hex[:8]}.tmp"  # two writes of one image never share it
        try:
            temporary.write_bytes(data)
            temporary.replace(self.path(digest))
        except OSError:
            temporary.unlink(missing_ok=True)
            raise
        self.add(digest, len(data))

    def touch(self, digests: Iterable[str]) -> None:
        """Used now (handed to a runner): the last to go."""
        for digest in digests:
            if digest in self._sizes:
                self._sizes.move_to_end(digest)
                with contextlib.suppress(OSError):
                    os.utime(self.path(digest))

    def trim(self, needed: Iterable[str]) -> list[str]:
        """Evict least recently used files, except `needed`, until within the limit; the evicted."""
        if self._total <= self.limit_bytes:
            self._over_logged = False
            return []
        keep = set(needed)
        evicted: list[str] = []
        for digest in list(self._sizes):
            if self._total <= self.limit_bytes:
                break
            if digest in keep:
                continue
            self._total -= self._sizes.pop(digest)
            evicted.append(digest)
            try:
                self.path(digest).unlink(missing_ok=True)
            except OSError as error:
                log.warning("%s cache: cannot remove %s: %s", self._what, digest, error)
        if evicted:
            log.info("%s cache: evicted %d files (%d bytes kept, limit %d)", self._what, len(evicted), self._total,
                     self.limit_bytes)
        over = self._total > self.limit_bytes
        if over and not self._over_logged:
            log.warning("%s cache: the files this node's work needs take %d bytes, over the limit of %d (%s); keeping "
                        "them until it is done", self._what, self._total, self.limit_bytes, self._setting)
        self._over_logged = over
        return evicted
