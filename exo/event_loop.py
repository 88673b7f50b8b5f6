"""Run a coroutine on uvloop where it is installed: every hop of a request (HTTP, NATS, runner
pipes) goes through the event loop, and uvloop makes each one cheaper."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def run(main: Coroutine[Any, Any, T]) -> T:
    try:
        import uvloop
    except ImportError:  # Windows, or an install without it: the standard loop works too
        return asyncio.run(main)
    return uvloop.run(main)
