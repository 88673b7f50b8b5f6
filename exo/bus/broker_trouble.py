"""When this process last saw the broker in trouble: its connection lost, or an append to a
stream not acknowledged (the stream between leaders, a server gone). Other nodes' pulses may
have been held up by the same trouble, so their silence meanwhile proves nothing about them
(exo/master/service.py's suspect check waits a full window after it)."""

from __future__ import annotations

import time

_last = float("-inf")


def note() -> None:
    global _last
    _last = time.monotonic()


def last() -> float:
    """time.monotonic() of the last trouble this process saw (-inf: none)."""
    return _last
