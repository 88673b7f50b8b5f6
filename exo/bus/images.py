"""Chat images in the object store exo-images, named by the sha256 hex of their bytes
(exo/bus/blobs.py does the storing and the verified fetching)."""

from __future__ import annotations

from nats.aio.client import Client

from exo.bus.blobs import (
    BlobCorrupt,
    BlobMissing,
    BlobStoreFull,
    BlobUnavailable,
    Bucket,
    delete_blob,
    digest_of,
    fetch_blob,
    store_blob,
)
from exo.bus.subjects import IMAGES_BUCKET

IMAGES = Bucket(IMAGES_BUCKET, "image", "try again once older images expire")

# The image store's errors are the blob store's: these names say what callers catch.
ImageUnavailable = BlobUnavailable
ImageMissing = BlobMissing
ImageCorrupt = BlobCorrupt
ImageStoreFull = BlobStoreFull
image_digest = digest_of


async def store_image(nc: Client, data: bytes, digest: str = "") -> tuple[str, bool]:
    """(sha256 hex, whether it was uploaded now rather than already there)."""
    return await store_blob(nc, IMAGES, data, digest)


async def delete_image(nc: Client, digest: str) -> None:
    """Remove an image stored for a request that was then refused (nothing else refers to it)."""
    await delete_blob(nc, IMAGES, digest)


async def fetch_image(nc: Client, digest: str, timeout: float = 60.0) -> bytes:
    """The image's bytes, verified against its name; ImageUnavailable, saying why, if that fails."""
    return await fetch_blob(nc, IMAGES, digest, timeout)
