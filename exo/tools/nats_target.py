"""Where a tool finds NATS: the node's own way (--nats / EXO_NATS_URL, else the embedded server of
the data dir: --data-dir / EXO_HOME / ~/.exo), and a line saying where that came from, for errors."""

from __future__ import annotations

import json
import os
from pathlib import Path

import msgspec

from exo.bus.server.embedded import CREDENTIALS_FILE, load_credentials, with_user
from exo.bus.server.permissions import OPERATOR_USER

DEFAULT_NATS_URL = "nats://127.0.0.1:4222"


class NatsTarget(msgspec.Struct, frozen=True, kw_only=True):
    urls: str  # comma-separated, maybe with the operator's credentials in them
    source: str  # where they came from, for an error: "--nats", "data dir /x: no node has run there"


def nats_target(nats: str | None, nats_env: str, data_dir: str) -> NatsTarget:
    """`nats`: the --nats flag (None: not given); `nats_env`: EXO_NATS_URL; `data_dir`: the node's,
    as --data-dir, EXO_HOME or the default give it."""
    if nats:
        return NatsTarget(urls=nats, source="--nats")
    if nats_env:
        return NatsTarget(urls=nats_env, source="EXO_NATS_URL")
    home = Path(data_dir).expanduser()
    store = home / "nats"
    running = running_server_url(store)
    if running is None:
        why = "no live server in its nats/ports" if (store / CREDENTIALS_FILE).exists() else "no node has run there"
        return NatsTarget(urls=_as_operator(DEFAULT_NATS_URL, store), source=f"data dir {home}: {why}")
    return NatsTarget(urls=_as_operator(running, store), source=f"data dir {home}")


def _as_operator(url: str, store: Path) -> str:
    """The URL with the read-only operator's password, where the node made one."""
    if not (store / CREDENTIALS_FILE).exists():
        return url
    return with_user(url, OPERATOR_USER, load_credentials(store).operator_password)


def running_server_url(store: Path) -> str | None:
    """The client URL a live embedded server of this store wrote to its ports file (a node started
    with `--nats-port 0` or another port is not on 4222), preferring loopback; None if none runs."""
    for ports_file in sorted((store / "ports").glob("*.ports")):
        try:
            pid = int(ports_file.stem.rsplit("_", 1)[1])
            os.kill(pid, 0)  # a file a killed server left behind names a port nobody listens on
            urls = json.loads(ports_file.read_text())["nats"]
        except (ValueError, IndexError, KeyError, TypeError, OSError):
            continue
        loopback = [u for u in urls if isinstance(u, str) and "://127.0.0.1:" in u]
        if loopback or urls:
            return str((loopback or urls)[0])
    return None
