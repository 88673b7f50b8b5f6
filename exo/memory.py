"""This machine's memory, for placement (the worker's heartbeat) and the runner's prompt-cache budget."""

from __future__ import annotations

import os
from pathlib import Path


def memory() -> tuple[int, int]:
    """Total and available bytes (MemAvailable on Linux: what can be had without swapping)."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    available = total
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
    except OSError:
        pass
    return total, available
