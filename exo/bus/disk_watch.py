"""A full disk under the embedded server: said while it lasts, and recovered from by itself.

When a write of JetStream's file store fails for lack of space, nats-server marks that stream's
store as failed and keeps failing it ("no space left on device") even after space returns: every
publish to it times out until the server restarts. So the node watches the disk its store is on:
while it is nearly full, `problem` says so (the API answers writes with a 507 naming it and
/health says "degraded"); once there is room again after the disk was full, or after the server
logged a failed write, the node restarts it (its supervisor brings it back on the same port with the same store, clients
reconnect, and everything acknowledged is in the file store).
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import signal
from collections.abc import Callable
from pathlib import Path

from exo.bus.server.embedded import EmbeddedNats

log = logging.getLogger(__name__)

LOW_SPACE_BYTES = 32 << 20  # below this the disk counts as full: JetStream's next block may not fit
CHECK_EVERY_S = 1.0
_WRITE_FAILED = b"no space left on device"


def free_bytes(path: Path) -> int:
    return shutil.disk_usage(path).free


class DiskWatch:
    def __init__(self, server: EmbeddedNats, low_space_bytes: int = LOW_SPACE_BYTES,
                 free_space: Callable[[Path], int] = free_bytes) -> None:
        self._server = server
        self._low = low_space_bytes
        self._free_space = free_space  # the free bytes of a path's disk (a test gives its own)
        self._log_path: Path = server.store_dir / "nats-server.log"
        self._log_offset = self._log_size()  # only what the server logs from now on counts
        self._write_failed = False
        self._was_full = False
        self.problem: str | None = None  # why this node's NATS cannot store anything now; None: it can

    async def run(self) -> None:
        while True:
            try:
                await self._check()
            except OSError as error:  # the store's disk itself unreadable: say so, look again
                self.problem = f"cannot check the disk of {self._server.store_dir}: {error}"
            await asyncio.sleep(CHECK_EVERY_S)

    async def _check(self) -> None:
        free = self._free_space(self._server.store_dir)
        self._write_failed = self._write_failed or self._logged_write_failure()
        # Full below `low`, room again only above twice that: a disk near the line does not flap.
        if free < self._low or (self._was_full and free < 2 * self._low):
            # The server's log is on the same disk: its "no space left" line may never be written,
            # so having been full counts as a failed write too.
            self._was_full = self._write_failed = True
            if self.problem is None:
                log.error("the disk of %s is full (%d MB free): the event log cannot take anything; free some "
                          "space and exo recovers by itself", self._server.store_dir, free >> 20)
            self.problem = (f"the disk of this node's NATS store ({self._server.store_dir}) is full: {free >> 20} MB "
                            "free; free some space, exo recovers by itself")
            return
        if self._write_failed:
            self.problem = "recovering from a full disk: restarting the embedded NATS server"
            log.warning("space is back on %s after failed writes: restarting the embedded nats-server so that its "
                        "streams take writes again", self._server.store_dir)
            self._write_failed = self._was_full = False
            self._log_offset = self._log_size()
            await self._restart()
            return
        if self.problem is not None:
            log.info("the disk of %s has room again", self._server.store_dir)
        self.problem = None

    async def _restart(self) -> None:
        """End the server; its supervisor (EmbeddedNats.supervise) starts it again on its port."""
        process = self._server.process
        if process is not None and process.poll() is None:
            process.send_signal(signal.SIGTERM)
            await asyncio.to_thread(process.wait)
        for _ in range(100):  # back within ~10 s, or the next turn says what is wrong
            current = self._server.process
            if current is not process and current is not None and current.poll() is None:
                break
            await asyncio.sleep(0.1)

    def _log_size(self) -> int:
        try:
            return self._log_path.stat().st_size
        except OSError:
            return 0

    def _logged_write_failure(self) -> bool:
        size = self._log_size()
        if size < self._log_offset:  # the log was replaced
            self._log_offset = 0
        if size == self._log_offset:
            return False
        with open(self._log_path, "rb") as file:
            file.seek(self._log_offset)
            new = file.read(size - self._log_offset)
        self._log_offset = size
        return _WRITE_FAILED in new
