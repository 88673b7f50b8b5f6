"""Our own small exception types for what the broker can tell us."""

import asyncio

import nats.errors


class BusError(Exception):
    """Something about NATS / JetStream that exo cannot work around."""


class ConfigMismatch(BusError):
    """A stream or consumer exists with a configuration different from streams/*.json."""


class LogGap(BusError):
    """The event stream no longer holds the sequence a reader needs next."""


# Whatever the broker or its client can raise (nats-py's errors included): callers outside
# exo/bus catch this tuple instead of importing `nats`.
BROKER_ERRORS: tuple[type[Exception], ...] = (BusError, nats.errors.Error)


def raise_if_cancelled() -> None:
    """For a retry loop that caught a broker error: nats-py swallows a cancellation in places (a
    flush, a close) or turns it into its own errors, so the loop re-raises it here instead of
    trying again forever (a master cancelled after its connection closed did: a test session never
    ended)."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError
