"""The runner's side of cache-aware routing: what its prompt cache holds goes to the worker, which
passes rank 0's on to the master (docs/prompt-cache.md, "What each cache holds")."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from exo.core.cache_reports import CacheContents
from exo.runner.prompt_cache import PromptCache
from exo.runner.protocol import CacheHeld, Report

CACHE_REPORT_S = 0.5  # how often at most: a batch that ends many requests at once sends one report


async def report_cache_contents(cache: Callable[[], PromptCache], report: Callable[[Report], None]) -> None:
    """`CacheHeld` each time the cache's contents changed, at most every CACHE_REPORT_S (the first
    at once: a runner that starts holds nothing). `cache`: the engine's, which a load replaces."""
    sent: CacheContents | None = None
    while True:
        if (contents := cache().contents) is not sent:
            report(CacheHeld(contents=contents))
            sent = contents
        await asyncio.sleep(CACHE_REPORT_S)
