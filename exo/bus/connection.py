"""Connecting to NATS the way every exo process should."""

from __future__ import annotations

import logging

import nats
from nats.aio.client import Client

from exo.bus.errors import BusError

log = logging.getLogger(__name__)


async def _quiet(error: Exception) -> None:
    pass


def split_urls(urls: str) -> list[str]:
    return [u.strip() for u in urls.split(",") if u.strip()]


async def connect(urls: list[str], name: str) -> Client:
    """Connect once (a bad URL fails fast), then reconnect forever once connected."""

    async def on_error(error: Exception) -> None:
        log.warning("nats (%s): %s", name, error)

    async def on_disconnected() -> None:
        log.warning("nats (%s): disconnected, reconnecting", name)

    try:
        # nats-py never gives up on a first connection when reconnects are unlimited, so a
        # one-shot probe turns a wrong URL into a prompt, clear error.
        # (nats-py retries a refused first connect until max_reconnect_attempts, whatever
        # allow_reconnect says, and 0 means forever; hence 1).
        probe = await nats.connect(
            servers=urls, allow_reconnect=False, max_reconnect_attempts=1, reconnect_time_wait=0.2,
            connect_timeout=3, error_cb=_quiet,
        )
        await probe.close()
        return await nats.connect(
            servers=urls,
            name=name,
            max_reconnect_attempts=-1,
            reconnect_time_wait=0.5,
            connect_timeout=3,
            allow_reconnect=True,
            error_cb=on_error,
            disconnected_cb=on_disconnected,
        )
    except Exception as error:  # nats-py raises several unrelated types here
        raise BusError(f"cannot connect to NATS at {', '.join(urls)}: {error or type(error).__name__}") from error
