"""What `exo inspect` shows: every stream with its consumers and their lag, the KV buckets and
their keys, the object stores and their objects, and (optionally) the server's monitoring
endpoint. Plain data out, so the tool only formats it.

Streams and consumers come straight from the JetStream API's JSON (nats-py's dataclasses drop
fields such as the last message's time); buckets and objects through nats-py's KV and object
store clients, which know their subject layouts.
"""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import msgspec
from nats.aio.client import Client
from nats.js.errors import KeyDeletedError, KeyNotFoundError, NotFoundError

from exo.bus.errors import BusError
from exo.bus.snapshots import covered_seq
from exo.bus.subjects import SNAPSHOT_KEY, STATE_BUCKET

_API_TIMEOUT_S = 5.0
# NATS's own naming of the streams behind KV buckets and object stores (not exo's names).
_KV_STREAM_PREFIX, _OBJECT_STREAM_PREFIX = "KV_", "OBJ_"


class ConsumerView(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    durable: bool
    pull: bool
    filter: str
    lag: int  # stream messages not yet delivered to it (num_pending)
    ack_pending: int
    redelivered: int
    waiting_pulls: int
    delivered_seq: int
    ack_floor_seq: int


class StreamView(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    subjects: list[str]
    storage: str
    messages: int
    bytes: int
    first_seq: int
    last_seq: int
    last_time: str  # RFC 3339; "" when the stream has never held a message
    consumers: list[ConsumerView]
    replicas: int = 1
    cluster: str = ""  # the JetStream cluster's name; "" on a standalone server
    leader: str = ""  # the server that leads the stream (in a cluster)
    followers: list[str] = []  # the other servers holding it, "(offline)" or "(behind)" noted


class KeyView(msgspec.Struct, frozen=True, kw_only=True):
    key: str
    revision: int
    bytes: int
    revisions_kept: int
    note: str = ""  # for the State snapshot: the sequence it covers


class BucketView(msgspec.Struct, frozen=True, kw_only=True):
    bucket: str
    values: int
    bytes: int
    keys: list[KeyView]
    keys_left_out: int = 0


class ObjectView(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    size: int
    chunks: int
    modified: str
    digest: str


class ObjectStoreView(msgspec.Struct, frozen=True, kw_only=True):
    bucket: str
    bytes: int
    objects: list[ObjectView]
    objects_left_out: int = 0


class ServerView(msgspec.Struct, frozen=True, kw_only=True):
    url: str
    version: str
    jetstream_storage_bytes: int
    jetstream_memory_bytes: int
    monitor: dict[str, object] | None = None  # chosen fields of /varz, when a monitoring URL is given


class Inspection(msgspec.Struct, frozen=True, kw_only=True):
    server: ServerView
    streams: list[StreamView]
    buckets: list[BucketView]
    object_stores: list[ObjectStoreView]


async def inspect_nats(nc: Client, monitor_url: str | None = None, max_items: int = 50) -> Inspection:
    raw_streams = await _api_list(nc, "$JS.API.STREAM.LIST", "streams")
    streams = [await _stream_view(nc, raw) for raw in raw_streams]
    names = [s.name for s in streams]
    buckets = [await _bucket_view(nc, n.removeprefix(_KV_STREAM_PREFIX), max_items)
               for n in names if n.startswith(_KV_STREAM_PREFIX)]
    stores = [await _store_view(nc, n.removeprefix(_OBJECT_STREAM_PREFIX), max_items)
              for n in names if n.startswith(_OBJECT_STREAM_PREFIX)]
    account = await nc.jetstream().account_info()
    where = nc.connected_url  # shown without any user:password it may hold
    version = nc.connected_server_version
    server = ServerView(url=f"{where.scheme}://{where.hostname}:{where.port}" if where else "",
                        version=f"{version.major}.{version.minor}.{version.patch}", jetstream_storage_bytes=account.storage,
                        jetstream_memory_bytes=account.memory,
                        monitor=await read_monitor(monitor_url) if monitor_url else None)
    return Inspection(server=server, streams=streams, buckets=buckets, object_stores=stores)


async def _api(nc: Client, subject: str, body: dict[str, Any]) -> dict[str, Any]:
    reply: dict[str, Any] = json.loads((await nc.request(subject, json.dumps(body).encode(), timeout=_API_TIMEOUT_S)).data)
    if "error" in reply:
        raise BusError(f"{subject}: {reply['error'].get('description', reply['error'])}")
    return reply


async def _api_list(nc: Client, subject: str, field: str) -> list[dict[str, Any]]:
    """Every item of a paged JetStream list response."""
    items: list[dict[str, Any]] = []
    while True:
        reply = await _api(nc, subject, {"offset": len(items)})
        page = reply.get(field) or []
        items.extend(page)
        if not page or len(items) >= reply.get("total", 0):
            return items


async def _stream_view(nc: Client, raw: dict[str, Any]) -> StreamView:
    config, state = raw["config"], raw["state"]
    consumers = await _api_list(nc, f"$JS.API.CONSUMER.LIST.{config['name']}", "consumers")
    last_time = state.get("last_ts", "") if state.get("last_seq") else ""
    return StreamView(
        name=config["name"], subjects=config.get("subjects", []), storage=config.get("storage", ""),
        messages=state["messages"], bytes=state["bytes"], first_seq=state["first_seq"], last_seq=state["last_seq"],
        last_time=last_time, consumers=[_consumer_view(c) for c in consumers],
        replicas=config.get("num_replicas", 1), cluster=(raw.get("cluster") or {}).get("name", ""),
        leader=(raw.get("cluster") or {}).get("leader", ""),
        followers=[_follower(r) for r in (raw.get("cluster") or {}).get("replicas") or []],
    )


def _follower(raw: dict[str, Any]) -> str:
    state = " (offline)" if raw.get("offline") else "" if raw.get("current") else " (behind)"
    name: str = raw.get("name", "?")
    return name + state


def _consumer_view(raw: dict[str, Any]) -> ConsumerView:
    config = raw["config"]
    return ConsumerView(
        name=raw["name"], durable=bool(config.get("durable_name")), pull=not config.get("deliver_subject"),
        filter=config.get("filter_subject") or ",".join(config.get("filter_subjects") or []),
        lag=raw.get("num_pending", 0), ack_pending=raw.get("num_ack_pending", 0),
        redelivered=raw.get("num_redelivered", 0), waiting_pulls=raw.get("num_waiting", 0),
        delivered_seq=raw.get("delivered", {}).get("stream_seq", 0),
        ack_floor_seq=raw.get("ack_floor", {}).get("stream_seq", 0),
    )


async def _bucket_view(nc: Client, bucket: str, max_keys: int) -> BucketView:
    js = nc.jetstream()
    kv = await js.key_value(bucket)
    info = await js.stream_info(_KV_STREAM_PREFIX + bucket, subjects_filter=">")
    key_subject_prefix = f"$KV.{bucket}."  # NATS's KV layout: one subject per key
    kept = {subject.removeprefix(key_subject_prefix): n for subject, n in (info.state.subjects or {}).items()}
    # The keys are the stream's subjects, not kv.keys(): its watcher can signal "no more" before the
    # first key arrives when the server delivers while it asks for the consumer's info (nats-py 2.16),
    # and a loaded CI run listed an empty bucket so.
    keys: list[KeyView] = []
    left_out = 0
    for name in sorted(kept):
        try:
            entry = await kv.get(name)
        except (KeyDeletedError, KeyNotFoundError):  # its last revision is a delete or purge marker
            continue
        if len(keys) == max_keys:
            left_out += 1
            continue
        value = entry.value or b""
        note = ""
        if bucket == STATE_BUCKET and name == SNAPSHOT_KEY and value:
            try:
                note = f"State at sequence {covered_seq(value)}"
            except (msgspec.DecodeError, msgspec.ValidationError):
                note = "not a State"
        keys.append(KeyView(key=name, revision=entry.revision or 0, bytes=len(value),
                            revisions_kept=kept.get(name, 0), note=note))
    return BucketView(bucket=bucket, values=info.state.messages, bytes=info.state.bytes, keys=keys,
                      keys_left_out=left_out)


async def _store_view(nc: Client, bucket: str, max_objects: int) -> ObjectStoreView:
    js = nc.jetstream()
    store = await js.object_store(bucket)
    info = await js.stream_info(_OBJECT_STREAM_PREFIX + bucket)
    try:
        listed = [o for o in await store.list(ignore_deletes=True) if not o.deleted]
    except NotFoundError:
        listed = []
    listed.sort(key=lambda o: o.name)
    objects = [ObjectView(name=o.name, size=o.size or 0, chunks=o.chunks or 0, modified=o.mtime or "",
                          digest=o.digest or "") for o in listed[:max_objects]]
    return ObjectStoreView(bucket=bucket, bytes=info.state.bytes, objects=objects,
                           objects_left_out=max(0, len(listed) - max_objects))


_MONITOR_FIELDS = ("server_name", "version", "uptime", "connections", "total_connections", "slow_consumers",
                   "in_msgs", "out_msgs", "in_bytes", "out_bytes", "mem", "cpu")


async def read_monitor(monitor_url: str) -> dict[str, object]:
    """Chosen fields of the server's /varz (its HTTP monitoring endpoint, e.g. http://127.0.0.1:8222), and in a
    cluster the meta group's leader and size from /jsz."""
    url = monitor_url.rstrip("/") + "/varz"
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=_API_TIMEOUT_S)) as session:
            async with session.get(url) as response:
                response.raise_for_status()
                varz = await response.json()
            async with session.get(monitor_url.rstrip("/") + "/jsz") as response:  # a cluster's meta group
                meta = (await response.json()).get("meta_cluster") if response.status == 200 else None
    except (aiohttp.ClientError, TimeoutError) as error:
        raise BusError(f"cannot read the NATS monitoring endpoint {url}: {error}") from None
    chosen = {field: varz[field] for field in _MONITOR_FIELDS if field in varz}
    if meta:
        chosen |= {"meta_leader": meta.get("leader", ""), "meta_cluster_size": meta.get("cluster_size", 0)}
    return chosen
