"""Bringing a standalone node's data into the cluster layout, once, at its first
start with discovery.

A standalone JetStream store cannot be reused in cluster mode: the server restores the streams
locally, but the meta group does not know them, so they are not served (seen with nats-server
2.15.1). So the old store is moved aside and served by a standalone server of its own, and its
messages are copied into the new cluster's streams: the event log with its sequence numbers
(the log's index: terms, snapshots and `since` all refer to them), the State snapshots and the
images. The leader lease, the command queue and token streams are live traffic of a node that
is no longer running and are not copied. The old store stays beside the new one as a backup.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import shutil
from pathlib import Path
from typing import Any

from nats.aio.client import Client

from exo.bus.atomic_append import BATCH_HEADERS
from exo.bus.connection import connect
from exo.bus.errors import BusError
from exo.bus.jetstream_api import jetstream_request
from exo.bus.provision import group_streams
from exo.bus.server.embedded import EmbeddedNats
from exo.bus.server.server_config import NODE_TAG
from exo.bus.subjects import ADAPTERS_STREAM, EVENTS_STREAM, IMAGES_STREAM, STATE_BUCKET

log = logging.getLogger(__name__)

BACKUP_DIR = "nats-standalone"  # beside the data dir's `nats`: the old store, kept
CARRIED = (EVENTS_STREAM, f"KV_{STATE_BUCKET}", IMAGES_STREAM, ADAPTERS_STREAM)
_NO_MESSAGE = 10037
_READ_AHEAD = 64  # messages read concurrently from the old store


def has_standalone_store(store_dir: Path) -> bool:
    """A store an earlier, standalone exo wrote: streams, and no cluster membership yet."""
    # nats-server keeps streams in <store_dir>/jetstream/<account>/streams/<name> under the
    # --store_dir given (EmbeddedNats gives <store>/jetstream)
    return any((store_dir / "jetstream").glob("jetstream/*/streams/*"))


def set_aside(store_dir: Path) -> None:
    """Move the standalone store out of the way of the cluster server, before that one starts."""
    backup = store_dir.parent / BACKUP_DIR
    if backup.exists():
        raise BusError(f"{backup} exists from an earlier migration; move it away to migrate {store_dir} again")
    backup.mkdir()
    (store_dir / "jetstream").rename(backup / "jetstream")


async def migrate_standalone_store(store_dir: Path, cluster_nc: Client) -> None:
    """Copy the store set aside from `store_dir` into the cluster `cluster_nc` reaches."""
    backup = store_dir.parent / BACKUP_DIR
    old = EmbeddedNats(backup, port=0, server_name="exo-standalone-backup")
    await old.start()
    old_nc = await connect([old.url], name="exo-migration")
    try:
        for name in [*CARRIED, *(n for n in await group_streams(old_nc) if n.startswith(f"{EVENTS_STREAM}_"))]:
            copied = await _copy_stream(old_nc, cluster_nc, name)
            log.info("migration: stream %s: %d message(s) copied into the cluster", name, copied)
    finally:
        await old_nc.close()
        old.stop()
    log.info("migration done; the standalone store is kept in %s (delete it once the cluster serves)", backup)


def undo_migration(store_dir: Path) -> None:
    """Put the old store back where it was (a failed migration must lose nothing)."""
    backup = store_dir.parent / BACKUP_DIR
    if (backup / "jetstream").exists():
        shutil.rmtree(store_dir / "jetstream", ignore_errors=True)
        (backup / "jetstream").rename(store_dir / "jetstream")
        shutil.rmtree(backup, ignore_errors=True)


async def _copy_stream(old_nc: Client, new_nc: Client, name: str) -> int:
    info = await jetstream_request(old_nc, f"$JS.API.STREAM.INFO.{name}", {})
    if info.get("error"):
        return 0  # an older store without it (no image was ever sent)
    first, last = info["state"]["first_seq"], info["state"]["last_seq"]
    # Its own config (retention an operator chose stays), placed on real nodes, from its first sequence.
    config = {key: value for key, value in info["config"].items() if key != "metadata"}
    config |= {"placement": {"tags": [NODE_TAG]}, "num_replicas": 1, "first_seq": max(first, 1)}
    created = await jetstream_request(new_nc, f"$JS.API.STREAM.CREATE.{name}", config)
    if created.get("error"):
        raise BusError(f"migration: cannot create {name} in the cluster: {created['error'].get('description')}")
    js, copied = new_nc.jetstream(), 0
    is_log = name == EVENTS_STREAM or name.startswith(f"{EVENTS_STREAM}_")  # the shared log or a master group's
    if not info["state"]["messages"]:
        return 0
    for start in range(first, last + 1, _READ_AHEAD):
        batch = await asyncio.gather(*(_message(old_nc, name, seq) for seq in range(start, min(start + _READ_AHEAD, last + 1))))
        for seq, message in zip(range(start, last + 1), batch, strict=False):
            if message is None:
                if is_log:  # the log's sequences are its index: a hole cannot be copied
                    raise BusError(f"migration: event {seq} is missing from the old log; it cannot keep its sequences")
                continue
            ack = await js.publish(message["subject"], _data(message), stream=name, headers=_headers(message))
            if is_log and ack.seq != seq:
                raise BusError(f"migration: event {seq} landed at {ack.seq}")
            copied += 1
    return copied


async def _message(nc: Client, stream: str, seq: int) -> dict[str, Any] | None:
    reply = await jetstream_request(nc, f"$JS.API.STREAM.MSG.GET.{stream}", {"seq": seq})
    if reply.get("error", {}).get("err_code") == _NO_MESSAGE:
        return None
    if reply.get("error"):
        raise BusError(f"migration: cannot read {stream} #{seq}: {reply['error'].get('description')}")
    message: dict[str, Any] = reply["message"]
    return message


def _data(message: dict[str, Any]) -> bytes:
    return base64.b64decode(message.get("data") or "")


def _headers(message: dict[str, Any]) -> dict[str, str] | None:
    """NATS/1.0 header block -> dict (exo's and the KV/object store's headers are single-valued), less
    an atomic batch's: each event is copied on its own (with them, the cluster would wait for a commit)."""
    raw = base64.b64decode(message.get("hdrs") or "").decode()
    lines = [line for line in raw.split("\r\n")[1:] if ":" in line]
    headers = {key.strip(): value.strip() for key, value in (line.split(":", 1) for line in lines)}
    return {key: value for key, value in headers.items() if key not in BATCH_HEADERS} or None
