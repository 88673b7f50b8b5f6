"""The watch of the embedded server's store disk, with the disk's free space given by the test: full
below LOW_SPACE_BYTES and, once it was full, until at least twice that is free again (a disk near the
line must not flap between "full" and restarting the server); then it restarts the server (its
supervisor brings it back) and has nothing more to say."""

from __future__ import annotations

import asyncio

from exo.bus.disk_watch import LOW_SPACE_BYTES, DiskWatch
from exo.bus.server.embedded import EmbeddedNats


def _full(server: EmbeddedNats, free: int) -> str:
    return (f"the disk of this node's NATS store ({server.store_dir}) is full: {free >> 20} MB free; "
            "free some space, exo recovers by itself")


async def test_a_disk_that_was_full_stays_full_until_twice_the_low_mark_is_free(fresh_server: EmbeddedNats):
    free = 10 * LOW_SPACE_BYTES
    watch = DiskWatch(fresh_server, free_space=lambda _: free)
    supervisor = asyncio.create_task(fresh_server.supervise())
    try:
        await watch._check()
        assert watch.problem is None
        free = LOW_SPACE_BYTES - 1
        await watch._check()
        assert watch.problem == _full(fresh_server, free)
        free = LOW_SPACE_BYTES * 3 // 2  # room by the low mark alone, not yet by the way back
        await watch._check()
        assert watch.problem == _full(fresh_server, free)

        before = fresh_server.process
        free = 2 * LOW_SPACE_BYTES + (1 << 20)
        await watch._check()
        assert watch.problem == "recovering from a full disk: restarting the embedded NATS server"
        assert before is not None and before.poll() is not None
        assert fresh_server.process is not before and fresh_server.process is not None
        assert fresh_server.process.poll() is None
        await watch._check()
        assert watch.problem is None
    finally:
        fresh_server.stop()
        await supervisor
