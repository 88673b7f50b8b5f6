"""Real images for tests that send them: the API refuses bytes that are not one (exo/api/images.py)."""

from __future__ import annotations

import io
import math
import os

import PIL.Image


def random_png(size_bytes: int) -> bytes:
    """A PNG of random pixels of about `size_bytes` (noise does not compress), never the same twice."""
    side = max(1, math.isqrt(max(1, size_bytes) // 3))
    image = PIL.Image.frombytes("RGB", (side, side), os.urandom(side * side * 3))
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()
