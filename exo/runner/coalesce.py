"""Fewer, larger messages when tokens come fast.

Every message wakes the runner's loop, nats-server, the API and the client; on a busy machine
those wake-ups steal time from the model's own threads. Text is sent at once when nothing
was sent for `interval` seconds (so the first token is never held), otherwise it waits for
the next token after the interval. A slow model (a token per interval or slower) streams
token by token, exactly as before.

A chunk carries reasoning and content, and the surfaces show its reasoning first: content held
when more reasoning comes is sent before it, so the order of the two is never changed.
"""

from __future__ import annotations

from typing import NamedTuple


class Piece(NamedTuple):
    text: str
    reasoning: str = ""


class Coalescer:
    def __init__(self, interval: float) -> None:
        self._interval = interval
        self._text = ""
        self._reasoning = ""
        self._last_sent = float("-inf")

    def add(self, text: str, now: float, reasoning: str = "") -> Piece | None:
        """Returns what to send now, or None to hold it."""
        if reasoning and self._text:  # reasoning after content: the content goes first, alone
            held = self._take(now)
            self._reasoning, self._text = reasoning, text  # this step's own content stays, after its reasoning
            return held
        self._text += text
        self._reasoning += reasoning
        if now - self._last_sent < self._interval:
            return None
        return self._take(now)

    def flush(self, now: float) -> Piece | None:
        return self._take(now) if self._text or self._reasoning else None

    def _take(self, now: float) -> Piece:
        piece = Piece(self._text, self._reasoning)
        self._text, self._reasoning, self._last_sent = "", "", now
        return piece
