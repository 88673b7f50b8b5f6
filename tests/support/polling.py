"""Waiting for a condition: tests and benches poll (a predicate tried every `interval` until a deadline),
because what they wait on is another process or the bus, with no event to await. The one
implementation behind tests.support.cluster.wait_until, tests.support.healing.wait_until and
tests.conftest.eventually."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(predicate: Callable[[], T | None], timeout: float, interval: float = 0.1, what: str = "condition",
               tolerate: tuple[type[Exception], ...] = ()) -> T:
    """The predicate's first truthy value. It is tried at least once and once more after the deadline
    (a condition met during the last sleep is not a failure); an exception in `tolerate` counts as
    "not yet"."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            value = predicate()
        except tolerate:
            value = None
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not met within {timeout} s")
        time.sleep(interval)


async def eventually(predicate: Callable[[], object], timeout: float = 10.0, interval: float = 0.02,
                     what: str = "condition") -> None:
    """wait_until for async tests: sleeps without blocking the event loop (the condition often
    depends on a task of that loop)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        if loop.time() > deadline:
            raise AssertionError(f"{what} not met within {timeout} s")
        await asyncio.sleep(interval)
