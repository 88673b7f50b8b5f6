"""Connecting to NATS the way every exo process should."""

from __future__ import annotations

import logging
import os
import re
import ssl
from typing import Any

import nats
from nats.aio.client import Client

from exo.bus import broker_trouble
from exo.bus.errors import BusError

# What the rest of exo holds: a connection to NATS. Only exo/bus imports `nats` (tests/test_layering.py).
Connection = Client

log = logging.getLogger(__name__)


async def _quiet(error: Exception) -> None:
    pass


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


# NATS security settings, read from the environment so that every exo process (runners
# included, which inherit it) connects the same way. `exo --nats-user ...` sets these too.
SECURITY_ENV = {
    "user": "EXO_NATS_USER", "password": "EXO_NATS_PASSWORD", "token": "EXO_NATS_TOKEN",
    "user_credentials": "EXO_NATS_CREDS", "tls_ca": "EXO_NATS_TLS_CA", "tls_cert": "EXO_NATS_TLS_CERT",
    "tls_key": "EXO_NATS_TLS_KEY",
}


def security_options() -> dict[str, Any]:
    """nats.connect keyword arguments for auth and TLS, from the environment."""
    values: dict[str, Any] = {key: os.environ[env] for key, env in SECURITY_ENV.items() if os.environ.get(env)}
    tls_ca, tls_cert, tls_key = values.pop("tls_ca", None), values.pop("tls_cert", None), values.pop("tls_key", None)
    if tls_ca or tls_cert:
        context = ssl.create_default_context(cafile=tls_ca)
        if tls_cert:
            context.load_cert_chain(tls_cert, tls_key)
        values["tls"] = context
    return values


async def connect(urls: list[str], name: str) -> Client:
    """Connect once (a bad URL fails fast), then reconnect forever once connected."""

    client = Client()

    async def on_error(error: Exception) -> None:
        log.warning("nats (%s): %s", name, error)

    async def on_disconnected() -> None:
        if not (client.is_closed or client.is_draining):  # closing on purpose is no news
            broker_trouble.note()
            log.warning("nats (%s): disconnected, reconnecting", name)

    async def on_reconnected() -> None:
        broker_trouble.note()  # the silence of others ends a full window after this, not before

    try:
        # nats-py never gives up on a first connection when reconnects are unlimited, so a
        # one-shot probe turns a wrong URL into a prompt, clear error.
        # (nats-py retries a refused first connect until max_reconnect_attempts, whatever
        # allow_reconnect says, and 0 means forever; hence 1).
        security = security_options()
        probe = await nats.connect(
            servers=urls, allow_reconnect=False, max_reconnect_attempts=1, reconnect_time_wait=0.2,
            connect_timeout=3, error_cb=_quiet, **security,
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
            **security,
        )
        return client
    except Exception as error:  # nats-py raises several unrelated types here
        shown = ", ".join(redact(url) for url in urls)
        raise BusError(f"cannot connect to NATS at {shown}: {error or type(error).__name__}") from error
