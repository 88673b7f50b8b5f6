"""Images in chat messages: OpenAI `image_url` parts with base64 `data:` URLs.

The API keeps only hashes in the command; the bytes go to the object store exo-images once
(a second send of the same image uploads nothing), and workers fetch them by hash. Images are
stored only for a request that can be served (`ImageUploads.stored`): one the master refuses leaves
nothing behind that it uploaded.
"""

from __future__ import annotations

import base64
import binascii
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from exo.api.errors import ApiError
from exo.bus.images import ImageStoreFull, delete_image, image_digest, store_image
from exo.core.state import State

MAX_IMAGE_BYTES = int(os.environ.get("EXO_MAX_IMAGE_BYTES", str(20 * 1024 * 1024)))
MAX_IMAGES = int(os.environ.get("EXO_MAX_IMAGES", "16"))  # per request
MAX_REQUEST_IMAGE_BYTES = int(os.environ.get("EXO_MAX_REQUEST_IMAGE_BYTES", str(64 * 1024 * 1024)))


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
        if len(self.by_digest) > MAX_IMAGES:
            raise ApiError(400, f"at most {MAX_IMAGES} images in one request", param=param)
        if sum(map(len, self.by_digest.values())) > MAX_REQUEST_IMAGE_BYTES:
            raise ApiError(413, f"the images of one request may total at most {MAX_REQUEST_IMAGE_BYTES} bytes", param=param)
        return digest

    @asynccontextmanager
    async def stored(self, nc, view, model_id: str) -> AsyncIterator[None]:
        """Stores the images for the block, which queues the request. If there is no instance to
        serve it, nothing is stored; if the block raises (the master refused it), the images
        uploaded here are deleted again, unless a task in State took them meanwhile."""
        if self.by_digest and not view.state.instances_of(model_id):
            raise ApiError(503, f"no instance of {model_id!r} is running; place one first", code="unavailable")
        uploaded: list[str] = []
        try:
            for data in self.by_digest.values():
                digest, new = await store_image(nc, data)
                uploaded += [digest] if new else []
        except ImageStoreFull as full:
            await _delete_unused(nc, view, uploaded)
            raise ApiError(507, str(full), code="insufficient_storage") from None
        try:
            yield
        except BaseException:
            await _delete_unused(nc, view, uploaded)
            raise


async def _delete_unused(nc, view, digests: list[str]) -> None:
    in_use = _images_of_open_tasks(view.state)
    for digest in digests:
        if digest not in in_use:
            await delete_image(nc, digest)


def _images_of_open_tasks(state: State) -> set[str]:
    return {digest for task in state.tasks.values() if task.status in ("pending", "running")
            for message in task.params.messages for digest in message.images}
