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
import nats.errors
from nats.aio.client import Client

from exo.bus import broker_trouble
from exo.bus.errors import BusError
from exo.bus.server.embedded import MAX_PAYLOAD_BYTES
from exo.bus.throttled_log import ThrottledLog
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
    reports = _ConnectionLog(client, name, urls, pinned=stays_on_given_servers(urls, security))
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
            error_cb=reports.on_error,
            disconnected_cb=reports.on_disconnected,
            reconnected_cb=reports.on_reconnected,
            discovered_server_cb=reports.on_discovered,
            **options,
        )
        await reports.on_discovered()  # the first server's INFO may already have advertised its cluster
        _SECURITY[client] = security
        return client
    except Exception as error:  # nats-py raises several unrelated types here
        shown = ", ".join(redact(url) for url in urls)
        raise BusError(f"cannot connect to NATS at {shown}: {error or type(error).__name__}") from error


def _has_credentials(url: str) -> bool:
    _, separator, rest = url.partition("://")
    return "@" in (rest if separator else url).partition("/")[0]


def stays_on_given_servers(urls: list[str], security: NatsSecurity) -> bool:
    """Whether a client retries only `urls`, never the servers their cluster advertises (INFO connect_urls).

    nats-py presents a URL's user and password to that URL alone: a discovered server gets none, and
    exo's embedded servers each have a password of their own anyway. So with the credentials in the
    URLs a discovered server can only answer "Authorization Violation": stay on the URLs given (list
    every server that should take over). Credentials given apart from the URLs (--nats-user, --nats-token,
    --nats-creds), or none, go to every server alike; a cluster sharing its accounts (an external NATS
    cluster) accepts them, so its advertised servers stay in the pool for failover, as nats-py does."""
    shared = security.user or security.token or security.user_credentials
    return not shared and any(_has_credentials(url) for url in urls)


# The client's own retries (and its consumers' requests timing out meanwhile) while it has no server:
# one condition, said when the server is lost and then at most once a minute.
_AWAY = "away"

# How nats-py reports the server going away; on_disconnected says it, in the one line for the loss.
_LOSS: tuple[type[Exception], ...] = (nats.errors.UnexpectedEOF, nats.errors.StaleConnectionError, OSError)


class _ConnectionLog:
    """nats-py's callbacks for one client: one WARNING when its server is lost and one INFO when it is
    back, the failed retries in between at DEBUG with a reminder at most once a minute; other errors
    at most once a minute per type (a slow consumer's, a refused publish's). With `pinned`, it keeps
    the server pool to the URLs given."""

    def __init__(self, client: Client, name: str, urls: list[str], pinned: bool) -> None:
        self._client, self._name, self._urls, self._pinned = client, name, urls, pinned
        self._said = ThrottledLog(log)
        self._loss = ""  # why the server went away, as nats-py reported it just before on_disconnected

    async def on_error(self, error: Exception) -> None:
        said = str(error) or type(error).__name__
        log.debug("nats (%s): %s", self._name, said)
        if self._client in _DISCONNECTED_AT:
            self._said.warning(_AWAY, "nats (%s): still no server; retrying %s, last error: %s",
                               self._name, self._retried(), said)
        elif isinstance(error, _LOSS):
            self._loss = said
        else:
            self._said.warning(type(error).__name__, "nats (%s): %s", self._name, said)

    async def on_disconnected(self) -> None:
        if self._client.is_closed or self._client.is_draining:  # closing on purpose is no news
            return
        broker_trouble.note()
        if self._client in _DISCONNECTED_AT:  # the first loss counts until a reconnect
            return
        _DISCONNECTED_AT[self._client] = time.monotonic()
        self._said.forget(_AWAY)
        self._said.warning(_AWAY, "nats (%s): lost its server (%s); retrying %s", self._name,
                           self._loss or "closed", self._retried())
        self._loss = ""

    async def on_reconnected(self) -> None:
        lost_at = _DISCONNECTED_AT.pop(self._client, None)
        broker_trouble.note()  # the silence of others ends a full window after this, not before
        await self.on_discovered()  # the new server's INFO advertised its cluster again
        self._said.forget(_AWAY)
        url = self._client.connected_url
        away = "" if lost_at is None else f" after {time.monotonic() - lost_at:.1f} s"
        log.info("nats (%s): reconnected to %s%s", self._name, redact(url.geturl()) if url else "its server", away)

    async def on_discovered(self) -> None:
        if self._pinned:
            # set_server_pool makes fresh entries: keep the version the current server announced
            current = self._client._current_server
            version = current.server_version if current is not None else None
            self._client.set_server_pool(self._urls)
            if self._client._current_server is not None and version:
                self._client._current_server.server_version = version

    def _retried(self) -> str:
        shown = ", ".join(redact(url) for url in self._urls)
        return shown if self._pinned else f"{shown} and the servers their cluster advertises"
