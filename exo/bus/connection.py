"""Connecting to NATS the way every exo process should."""

from __future__ import annotations

import logging
import re
import ssl
import time
import weakref
from typing import Any

import msgspec
import nats
from nats.aio.client import Client

from exo.bus import broker_trouble
from exo.bus.errors import BusError
from exo.bus.server.embedded import MAX_PAYLOAD_BYTES
from exo.settings.services import NatsSecurity

# What the rest of exo holds: a connection to NATS. Only exo/bus imports `nats` (tests/test_layering.py).
Connection = Client

log = logging.getLogger(__name__)


async def _quiet(error: Exception) -> None:
    pass


def max_payload(nc: Connection | None) -> int:
    """The largest message the connected server takes (its INFO's max_payload); without a
    connection (an API built for a test), the embedded server's."""
    return nc.max_payload if nc is not None else MAX_PAYLOAD_BYTES


def split_urls(urls: str) -> list[str]:
    return [u.strip() for u in urls.split(",") if u.strip()]


_HOST_PORT = re.compile(r"[\w.\-]*(:\d*)?|\[[0-9a-fA-F:.]*\](:\d*)?")


def redact(url: str) -> str:
    """The URL without a user or password in it: what logs and messages may show."""
    scheme, separator, rest = url.partition("://")
    if not separator:  # "host:port", or a piece of a URL split at a comma in its password
        scheme, rest = "", url
    authority, slash, path = rest.partition("/")
    if "@" in authority:
        authority = authority.rpartition("@")[2]
    elif not _HOST_PORT.fullmatch(authority):
        # Not a host: a password with a comma in it, split into pieces by the URL list. Show nothing of it.
        return f"{scheme}{separator}<unreadable URL>" if separator else "<unreadable URL>"
    return f"{scheme}{separator}{authority}{slash}{path}"


# The security each client connected with: a second connection of a tool's (connect_like) logs in the same way.
_SECURITY: weakref.WeakKeyDictionary[Client, NatsSecurity] = weakref.WeakKeyDictionary()


# When each client lost its server (time.monotonic()), until it has one again: /health's "since N s".
_DISCONNECTED_AT: weakref.WeakKeyDictionary[Client, float] = weakref.WeakKeyDictionary()


def disconnected_for(nc: Client) -> float | None:
    """Seconds `nc` has been without a server; None while connected (0 for a client not made by connect())."""
    if nc.is_connected:
        return None
    since = _DISCONNECTED_AT.get(nc)
    return 0.0 if since is None else time.monotonic() - since


async def connect_like(nc: Client, url: str, name: str) -> Client:
    """Another connection to `url`, with the credentials `nc` connected with."""
    return await connect([url], name, _SECURITY.get(nc, NatsSecurity()))


def security_options(security: NatsSecurity) -> dict[str, Any]:
    """nats.connect keyword arguments for auth and TLS (exo --nats-user ..., EXO_NATS_USER ...)."""
    values: dict[str, Any] = {key: value for key, value in msgspec.structs.asdict(security).items() if value}
    tls_ca, tls_cert, tls_key = values.pop("tls_ca", None), values.pop("tls_cert", None), values.pop("tls_key", None)
    if tls_ca or tls_cert:
        context = ssl.create_default_context(cafile=tls_ca)
        if tls_cert:
            context.load_cert_chain(tls_cert, tls_key)
        values["tls"] = context
    return values


async def connect(urls: list[str], name: str, security: NatsSecurity = NatsSecurity()) -> Client:
    """Connect once (a bad URL fails fast), then reconnect forever once connected."""

    client = Client()

    async def on_error(error: Exception) -> None:
        log.warning("nats (%s): %s", name, error)

    async def on_disconnected() -> None:
        if not (client.is_closed or client.is_draining):  # closing on purpose is no news
            broker_trouble.note()
            _DISCONNECTED_AT.setdefault(client, time.monotonic())  # the first loss counts until a reconnect
            log.warning("nats (%s): disconnected, reconnecting", name)

    async def on_reconnected() -> None:
        _DISCONNECTED_AT.pop(client, None)
        broker_trouble.note()  # the silence of others ends a full window after this, not before

    try:
        # nats-py never gives up on a first connection when reconnects are unlimited, so a
        # one-shot probe turns a wrong URL into a prompt, clear error.
        # (nats-py retries a refused first connect until max_reconnect_attempts, whatever
        # allow_reconnect says, and 0 means forever; hence 1).
        options = security_options(security)
        probe = await nats.connect(
            servers=urls, allow_reconnect=False, max_reconnect_attempts=1, reconnect_time_wait=0.2,
            connect_timeout=3, error_cb=_quiet, **options,
        )
        await probe.close()
        await client.connect(
            servers=urls,
            name=name,
            max_reconnect_attempts=-1,
            reconnect_time_wait=0.5,  # type: ignore[arg-type]  # nats-py types it int; it sleeps a float
            connect_timeout=3,
            allow_reconnect=True,
            error_cb=on_error,
            disconnected_cb=on_disconnected,
            reconnected_cb=on_reconnected,
            **options,
        )
        _SECURITY[client] = security
        return client
    except Exception as error:  # nats-py raises several unrelated types here
        shown = ", ".join(redact(url) for url in urls)
        raise BusError(f"cannot connect to NATS at {shown}: {error or type(error).__name__}") from error
