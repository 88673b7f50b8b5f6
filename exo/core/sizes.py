"""Sizes in bytes as people read them, for refusals and reports (placement's reasons first of all)."""

from __future__ import annotations


def human_bytes(count: int, digits: int = 1) -> str:
    """Sizes as people read them: "229 GB", "23.1 GB", "512 MB" (decimal units, as disks and Hub pages show)."""
    for unit, size in (("TB", 10**12), ("GB", 10**9), ("MB", 10**6), ("kB", 10**3)):
        shown = f"{count / size:.0f}" if abs(count) >= 100 * size and digits <= 1 else f"{count / size:.{digits}f}"
        if abs(count) >= size or float(shown) >= 1:  # 999.6 MB reads "1.0 GB", not "1000 MB"
            return f"{shown} {unit}"
    return f"{count} bytes"


def needed_and_free(need: int, free: int) -> tuple[str, str]:
    """Both sizes, with as many digits as it takes for a shortfall not to read "needs 8.0 GB, has 8.0 GB"."""
    for digits in (1, 2, 3):
        shown = human_bytes(need, digits), human_bytes(free, digits)
        if shown[0] != shown[1]:
            return shown
    return f"{need} bytes", f"{free} bytes"
