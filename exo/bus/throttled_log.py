"""A WARNING for a condition that repeats (a server away, a consumer that cannot be recreated):
said at once, then at most once per interval with how many times it came meanwhile, so an
outage of minutes is a few lines instead of one per retry."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

REPEAT_EVERY_S = 60.0


class ThrottledLog:
    def __init__(self, logger: logging.Logger, every_s: float = REPEAT_EVERY_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._logger = logger
        self._every_s = every_s
        self._clock = clock
        self._said: dict[str, tuple[float, int]] = {}  # condition -> (when last said, times it came since)

    def warning(self, condition: str, message: str, *args: object) -> None:
        """Says `message` if `condition` was not said within the interval (with how many times it came
        since it was last said); otherwise only counts it."""
        now = self._clock()
        said, unsaid = self._said.get(condition, (float("-inf"), 0))
        if now - said < self._every_s:
            self._said[condition] = (said, unsaid + 1)
            return
        self._said[condition] = (now, 0)
        if unsaid:
            since = f"{message} (%d times in the %.0f s since the last such line)"
            self._logger.warning(since, *args, unsaid + 1, now - said)
        else:
            self._logger.warning(message, *args)

    def forget(self, condition: str) -> None:
        """The condition has cleared: its next occurrence is news again, said at once."""
        self._said.pop(condition, None)

    def cleared(self, condition: str, message: str, *args: object) -> None:
        """As `forget`, and says `message` at INFO if the condition had been said (its end is news too)."""
        if self._said.pop(condition, None) is not None:
            self._logger.info(message, *args)
