"""Fewer, larger messages when tokens come fast.

Every message wakes the runner's loop, nats-server, the API and the client; on a busy machine
those wake-ups steal time from the model's own threads. Text is sent at once when nothing
was sent for `interval` seconds (so the first token is never held), otherwise it waits for
the next token after the interval. A slow model (a token per interval or slower) streams
token by token, exactly as before.
"""

from __future__ import annotations


class Coalescer:
    def __init__(self, interval: float) -> None:
        self._interval = interval
        self._pending = ""
        self._last_sent = float("-inf")

    def add(self, text: str, now: float) -> str | None:
        """Returns text to send now, or None to hold it."""
        self._pending += text
        if now - self._last_sent < self._interval:
            return None
        return self._take(now)

    def flush(self, now: float) -> str | None:
        return self._take(now) if self._pending else None

    def _take(self, now: float) -> str:
        text, self._pending, self._last_sent = self._pending, "", now
        return text
