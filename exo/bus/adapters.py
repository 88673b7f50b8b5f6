"""LoRA adapters' weights in the object store exo-adapters, named by the sha256 hex of their
bytes (exo/bus/blobs.py does the storing and the verified fetching). Kept until deleted: State
lists which adapters exist (exo/core/adapters.py)."""

from __future__ import annotations

from nats.aio.client import Client

from exo.bus.blobs import Bucket, delete_blob, fetch_blob, store_blob, stored_blobs
from exo.bus.subjects import ADAPTERS_BUCKET

ADAPTERS = Bucket(ADAPTERS_BUCKET, "adapter", "delete adapters no longer used (DELETE /adapters/{name})")


async def store_adapter(nc: Client, data: bytes, digest: str = "") -> tuple[str, bool]:
    return await store_blob(nc, ADAPTERS, data, digest)


async def delete_adapter(nc: Client, digest: str) -> None:
    await delete_blob(nc, ADAPTERS, digest)


async def fetch_adapter(nc: Client, digest: str, timeout: float) -> bytes:
    return await fetch_blob(nc, ADAPTERS, digest, timeout)


async def stored_adapter_weights(nc: Client) -> dict[str, float]:
    """Every adapter's weights in exo-adapters, by sha256, and when they were written (epoch s)."""
    return await stored_blobs(nc, ADAPTERS)
