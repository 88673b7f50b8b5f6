"""`keep_alive` as Ollama reads it: a number of seconds, or a Go duration string ("5m", "1h30m",
"250ms"); 0 unloads the model right after the request, a negative value never. A request carries it
to the master (GenerateText.keep_alive_s), where it becomes its model's desire's."""

from __future__ import annotations

import math
import re

from exo.api.errors import ApiError

# Go's time.ParseDuration units, which Ollama's Duration decodes strings with.
_UNIT_S = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "μs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_PART = re.compile(r"(\d+\.?\d*|\.\d+)(ns|us|µs|μs|ms|s|m|h)")
_DURATION = re.compile(rf"[-+]?(?:{_PART.pattern})+")
NEVER = -1.0  # what a negative keep_alive becomes: kept until deleted
MAX_KEEP_ALIVE_S = 100 * 365 * 86400.0  # past a century, a finite keep_alive means never


def keep_alive_seconds(value: str | int | float | None, param: str = "keep_alive") -> float | None:
    """Seconds the model stays loaded after the request (-1: never unloaded; None: not given, the
    desire's own), or a 400 naming `param` for anything Ollama would not read as a duration."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise _invalid(value, param)
    seconds = float(value) if not isinstance(value, str) else _duration_s(value.strip(), param)
    if math.isnan(seconds):
        raise _invalid(value, param)
    return NEVER if seconds < 0 or seconds > MAX_KEEP_ALIVE_S else seconds


def _duration_s(text: str, param: str) -> float:
    if text in ("0", "+0", "-0"):
        return 0.0  # Go's one unitless duration
    if not _DURATION.fullmatch(text):
        raise _invalid(text, param)
    seconds = sum(float(amount) * _UNIT_S[unit] for amount, unit in _PART.findall(text))
    return -seconds if text.startswith("-") else seconds


def _invalid(value: object, param: str) -> ApiError:
    return ApiError(400, f"{param} must be a duration (\"5m\", \"30s\", \"1h\", \"250ms\"), a number of seconds, 0 to "
                         f"unload after the request or negative to keep the model loaded, got {value!r}", param=param)
