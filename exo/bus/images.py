"""Chat images in the object store exo-images, named by the sha256 hex of their bytes.

Storing skips the upload when the object is already there (same name, same bytes). Fetching
reads the chunks with our own callback consumer: nats-py's ObjectStore.get is very slow for
large objects. Every fetch is verified against the name.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext, api
from nats.js.errors import APIError, ObjectNotFoundError
from nats.js.object_store import ObjectStore

from exo.bus.errors import BROKER_ERRORS, BusError
from exo.bus.subjects import IMAGES_BUCKET, IMAGES_STREAM, image_chunks_subject

# What reading an image can raise besides our own: the broker's errors, a chunk read that timed out.
_READ_ERRORS: tuple[type[Exception], ...] = (*BROKER_ERRORS, asyncio.TimeoutError)


class ImageUnavailable(BusError):
    """An image that cannot be had: missing, corrupt, or the broker failed reading it. Its message
    says which, for the client whose request needed it."""


class ImageMissing(ImageUnavailable):
    pass


class ImageCorrupt(ImageUnavailable):
    pass


class ImageStoreFull(BusError):
    """exo-images holds its byte limit (streams/OBJ_exo-images.json): nothing was stored."""


def image_digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _store(nc: Client) -> ObjectStore:
    """The bucket's handle, made directly: nats-py's `js.object_store()` asks for the stream's info
    first, one round trip more on every image's path (provision() made the bucket)."""
    return ObjectStore(name=IMAGES_BUCKET, stream=IMAGES_STREAM, js=nc.jetstream())


async def store_image(nc: Client, data: bytes, digest: str = "") -> tuple[str, bool]:
    """(sha256 hex, whether it was uploaded now rather than already there). `digest`: the bytes'
    sha256 where the caller has it already."""
    digest = digest or image_digest(data)
    store = _store(nc)
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
            raise ImageStoreFull(f"the image store is full ({error.description}); try again once older images expire") from None
        raise
    return digest, True


async def delete_image(nc: Client, digest: str) -> None:
    """Remove an image stored for a request that was then refused (nothing else refers to it)."""
    store = _store(nc)
    with contextlib.suppress(ObjectNotFoundError):
        await store.delete(digest)


async def fetch_image(nc: Client, digest: str, timeout: float = 60.0) -> bytes:
    """The image's bytes, verified against its name; ImageUnavailable, saying why, if that fails."""
    try:
        return await _fetch(nc, digest, timeout)
    except ImageUnavailable:
        raise
    except _READ_ERRORS as error:  # a retry might loop: the caller gives up
        raise ImageUnavailable(f"cannot fetch image {digest}: {error!r}") from None


async def _fetch(nc: Client, digest: str, timeout: float) -> bytes:
    js = nc.jetstream()
    store = _store(nc)
    try:
        info = await store.get_info(digest)
    except ObjectNotFoundError:
        raise ImageMissing(f"image {digest} is not in the object store (expired or never stored)") from None
    data = await _read_chunks(js, info, timeout) if info.chunks else b""
    if image_digest(data) != digest:
        raise ImageCorrupt(f"image {digest}: the bytes read back hash to {image_digest(data)}")
    return data


async def _read_chunks(js: JetStreamContext, info: api.ObjectInfo, timeout: float) -> bytes:
    chunks: list[bytes] = []
    done: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    async def on_chunk(msg: Msg) -> None:
        chunks.append(msg.data)
        if len(chunks) == info.chunks and not done.done():
            done.set_result(None)

    subscription = await js.subscribe(
        image_chunks_subject(info.nuid), stream=IMAGES_STREAM, ordered_consumer=True,
        deliver_policy=api.DeliverPolicy.ALL, cb=on_chunk,
    )
    try:
        await asyncio.wait_for(done, timeout)
    finally:
        await subscription.unsubscribe()
    return b"".join(chunks)
