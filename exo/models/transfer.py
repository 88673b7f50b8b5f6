"""A file on its way to disk: appended to, hashed as it arrives, resumed across restarts,
verified against what its source says it must be, then moved into place.

Sources (the Hub over HTTP, a peer over NATS) only hand bytes to `PartialFile.write`.
"""

from __future__ import annotations

import errno
import hashlib
import os
from pathlib import Path
from typing import Any, BinaryIO

from exo.core.types import DownloadErrorCode
from exo.models.dirs import PARTIAL_DIR
from exo.models.files import FileMeta

_READ_BLOCK = 8 << 20


class DownloadError(Exception):
    def __init__(self, code: DownloadErrorCode, reason: str) -> None:
        super().__init__(reason)
        self.code: DownloadErrorCode = code
        self.reason = reason


class DownloadCancelled(Exception):
    pass


class Corrupt(Exception):
    """The bytes do not match the source's size or hash: fetch the file again."""


class PartialFile:
    """`<model dir>/.exo-partial/<path>` until verified, then `<model dir>/<path>`.

    Not thread-safe: one thread writes a file at a time. `size` is read from other threads
    for progress, which is fine for an int.
    """

    def __init__(self, model_dir: Path, path: str, meta: FileMeta) -> None:
        self.path = path
        self.meta = meta
        self.final = model_dir / path
        self.partial = model_dir / PARTIAL_DIR / path
        self.size = 0
        self._file: BinaryIO | None = None
        self._sha256 = hashlib.sha256()
        self._git: Any = None  # hashlib's sha1, for files the Hub keeps in git

    def open(self) -> int:
        """Start or resume; returns the bytes already on disk (hashed again, so a resumed
        file is verified as a whole)."""
        self.close()
        self.partial.parent.mkdir(parents=True, exist_ok=True)
        have = self.partial.stat().st_size if self.partial.exists() else 0
        if have > self.meta.size:
            have = 0  # longer than the file can be: not ours to trust
        self._restart_hashes()
        with open(self.partial, "r+b" if self.partial.exists() else "w+b") as existing:
            existing.truncate(have)
            while block := existing.read(_READ_BLOCK):
                self._hash(block)
        self.size = have
        self._file = open(self.partial, "ab")  # noqa: SIM115  # closed by close()
        return have

    def reset(self) -> None:
        """Throw away what is there and start the file from byte 0."""
        self.close()
        self.partial.unlink(missing_ok=True)
        self.open()

    def write(self, data: bytes) -> None:
        assert self._file is not None, "write before open"
        try:
            self._file.write(data)
        except OSError as error:
            if error.errno in (errno.ENOSPC, errno.EDQUOT):
                raise DownloadError("disk_full", f"disk full writing {self.path} in {self.partial.parent}") from None
            raise DownloadError("io", f"cannot write {self.partial}: {error.strerror}") from None
        self._hash(data)
        self.size += len(data)

    def finish(self) -> FileMeta:
        """Verify and move into place; raises Corrupt (the partial file is then discarded)."""
        self.close()
        problem = self._mismatch()
        if problem:
            self.partial.unlink(missing_ok=True)
            raise Corrupt(f"{self.path}: {problem}")
        self.final.parent.mkdir(parents=True, exist_ok=True)
        os.replace(self.partial, self.final)
        return FileMeta(size=self.size, sha256=self._sha256.hexdigest(), git_oid=self.meta.git_oid)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def _mismatch(self) -> str:
        if self.size != self.meta.size:
            return f"{self.size} bytes, expected {self.meta.size}"
        if self.meta.sha256 and self._sha256.hexdigest() != self.meta.sha256:
            return f"sha256 {self._sha256.hexdigest()}, expected {self.meta.sha256}"
        if not self.meta.sha256 and self.meta.git_oid and self._git.hexdigest() != self.meta.git_oid:
            return f"git blob id {self._git.hexdigest()}, expected {self.meta.git_oid}"
        return ""

    def _restart_hashes(self) -> None:
        self._sha256 = hashlib.sha256()
        # Files the Hub keeps in git (not LFS) come with their git blob id, not a sha256.
        self._git = hashlib.sha1(b"blob %d\0" % self.meta.size) if not self.meta.sha256 else None

    def _hash(self, data: bytes) -> None:
        self._sha256.update(data)
        if self._git is not None:
            self._git.update(data)
