"""Images in chat messages: OpenAI `image_url` parts with base64 `data:` URLs.

The API keeps only hashes in the command; the bytes go to the object store exo-images once
(a second send of the same image uploads nothing), and workers fetch them by hash.
"""

from __future__ import annotations

import base64
import binascii
import os

from exo.api.errors import ApiError
from exo.bus.images import image_digest, store_image

MAX_IMAGE_BYTES = int(os.environ.get("EXO_MAX_IMAGE_BYTES", str(20 * 1024 * 1024)))


class ImageUploads:
    """The images of one request, decoded and hashed, waiting to be stored."""

    def __init__(self, max_bytes: int = MAX_IMAGE_BYTES) -> None:
        self.by_digest: dict[str, bytes] = {}
        self._max_bytes = max_bytes

    def add_data_url(self, url: str, param: str) -> str:
        if not url.startswith("data:"):
            raise ApiError(400, "image_url must be a base64 data: URL (this cluster fetches nothing from the web)", param=param)
        header, _, payload = url.partition(",")
        if not header.endswith(";base64") or not payload:
            raise ApiError(400, "image_url data: URL must be base64-encoded (data:image/png;base64,...)", param=param)
        if len(payload) * 3 // 4 > self._max_bytes + 3:
            raise ApiError(413, f"image larger than the limit of {self._max_bytes} bytes", param=param)
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise ApiError(400, "image_url data: URL is not valid base64", param=param) from None
        if len(data) > self._max_bytes:
            raise ApiError(413, f"image of {len(data)} bytes is larger than the limit of {self._max_bytes}", param=param)
        digest = image_digest(data)
        self.by_digest[digest] = data
        return digest

    async def store(self, nc) -> None:
        for data in self.by_digest.values():
            await store_image(nc, data)
