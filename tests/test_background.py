"""The one helper for tasks started and not awaited: a failure is logged, not lost."""

from __future__ import annotations

import asyncio
import logging

from exo.background import Background


async def test_a_failed_background_task_is_logged_and_forgotten(caplog):
    async def fails() -> None:
        raise RuntimeError("boom")

    background = Background("test")
    with caplog.at_level(logging.ERROR, logger="exo.background"):
        task = background.start(fails())
        await asyncio.wait({task})
        await asyncio.sleep(0)  # done callbacks run on the next loop turn
    assert len(background) == 0
    assert [(r.getMessage(), str(r.exc_info[1])) for r in caplog.records] == [("test: a background task failed", "boom")]


async def test_cancel_all_cancels_what_still_runs():
    background = Background("test")
    task = background.start(asyncio.sleep(60))
    background.cancel_all()
    await asyncio.wait({task})
    assert task.cancelled() and len(background) == 0
