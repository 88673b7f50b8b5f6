"""Objects named by the sha256 hex of their bytes, in an object store bucket: chat images
(exo-images) and LoRA adapters (exo-adapters).

Storing skips the upload when the object is already there (same name, same bytes). Fetching
reads the chunks with our own callback consumer: nats-py's ObjectStore.get is very slow for
large objects. Every fetch is verified against the name.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import hashlib
import time
from dataclasses import dataclass

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext, api
from nats.js.errors import APIError, NotFoundError, ObjectNotFoundError
from nats.js.object_store import ObjectStore

from exo.bus.errors import BROKER_ERRORS, BusError

# What reading an object can raise besides our own: the broker's errors, a chunk read that timed out.
_READ_ERRORS: tuple[type[Exception], ...] = (*BROKER_ERRORS, asyncio.TimeoutError)


class BlobUnavailable(BusError):
    """An object that cannot be had: missing, corrupt, or the broker failed reading it. Its message
    says which, for the client whose request needed it."""


class BlobMissing(BlobUnavailable):
    pass


class BlobCorrupt(BlobUnavailable):
    pass


class BlobStoreFull(BusError):
    """The bucket holds its byte limit (streams/OBJ_<bucket>.json): nothing was stored."""


@dataclass(frozen=True)
class Bucket:
    name: str  # the object store's bucket
    noun: str  # what it holds, for messages: "image", "adapter"
    when_full: str  # what a caller can do when it is full

    @property
    def stream(self) -> str:
        return f"OBJ_{self.name}"

    def chunks_subject(self, nuid: str) -> str:
        return f"$O.{self.name}.C.{nuid}"


def digest_of(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _store(nc: Client, bucket: Bucket) -> ObjectStore:
    """The bucket's handle, made directly: nats-py's `js.object_store()` asks for the stream's info
    first, one round trip more on every object's path (provision() made the bucket)."""
    return ObjectStore(name=bucket.name, stream=bucket.stream, js=nc.jetstream())


async def store_blob(nc: Client, bucket: Bucket, data: bytes, digest: str = "") -> tuple[str, bool]:
    """(sha256 hex, whether it was uploaded now rather than already there). `digest`: the bytes'
    sha256 where the caller has it already."""
    digest = digest or digest_of(data)
    store = _store(nc, bucket)
    try:
        info = await store.get_info(digest)
        if info.size == len(data):
            return digest, False
    except ObjectNotFoundError:
        pass
    try:
        await store.put(digest, data)  # on failure nats-py purges the chunks it wrote
    except APIError as error:
        if "maximum bytes" in str(error.description).lower():
            raise BlobStoreFull(f"the {bucket.noun} store is full ({error.description}); {bucket.when_full}") from None
        raise
    return digest, True


async def delete_blob(nc: Client, bucket: Bucket, digest: str) -> None:
    """Remove an object nothing refers to any more."""
    store = _store(nc, bucket)
    with contextlib.suppress(ObjectNotFoundError):
        await store.delete(digest)


async def stored_blobs(nc: Client, bucket: Bucket, timeout: float = 30.0) -> dict[str, float]:
    """Every object in the bucket (deleted ones left out) and when it was written, in epoch seconds
    by its writer's clock. One that says no readable time counts as written now: never old."""
    try:
        infos = await asyncio.wait_for(_store(nc, bucket).list(ignore_deletes=True), timeout)
    except NotFoundError:  # nats-py's answer for an empty bucket
        return {}
    now = time.time()
    return {info.name: _written_at(info.mtime, now) for info in infos if info.name}


def _written_at(mtime: str | None, now: float) -> float:
    try:
        written = datetime.datetime.fromisoformat(mtime or "")
    except ValueError:
        return now
    return written.timestamp() if written.tzinfo is not None else now


async def fetch_blob(nc: Client, bucket: Bucket, digest: str, timeout: float = 60.0) -> bytes:
    """The object's bytes, verified against its name; BlobUnavailable, saying why, if that fails."""
    try:
        return await _fetch(nc, bucket, digest, timeout)
    except BlobUnavailable:
        raise
    except _READ_ERRORS as error:  # a retry might loop: the caller gives up
        raise BlobUnavailable(f"cannot fetch {bucket.noun} {digest}: {error!r}") from None


async def _fetch(nc: Client, bucket: Bucket, digest: str, timeout: float) -> bytes:
    js = nc.jetstream()
    store = _store(nc, bucket)
    try:
        info = await store.get_info(digest)
    except ObjectNotFoundError:
        raise BlobMissing(f"{bucket.noun} {digest} is not in the object store {bucket.name} "
                          "(expired, deleted or never stored)") from None
    data = await _read_chunks(js, bucket, info, timeout) if info.chunks else b""
    if digest_of(data) != digest:
        raise BlobCorrupt(f"{bucket.noun} {digest}: the bytes read back hash to {digest_of(data)}")
    return data


async def _read_chunks(js: JetStreamContext, bucket: Bucket, info: api.ObjectInfo, timeout: float) -> bytes:
    chunks: list[bytes] = []
    done: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    async def on_chunk(msg: Msg) -> None:
        chunks.append(msg.data)
        if len(chunks) == info.chunks and not done.done():
            done.set_result(None)

    subscription = await js.subscribe(
        bucket.chunks_subject(info.nuid), stream=bucket.stream, ordered_consumer=True,
        deliver_policy=api.DeliverPolicy.ALL, cb=on_chunk,
    )
    try:
        await asyncio.wait_for(done, timeout)
    finally:
        await subscription.unsubscribe()
    return b"".join(chunks)
