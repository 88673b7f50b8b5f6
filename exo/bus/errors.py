"""Our own small exception types for what the broker can tell us."""

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
