"""Images in requests, on every surface: base64 `data:` URLs and http(s) URLs (OpenAI chat
`image_url` parts, Responses `input_image`, Anthropic `image` blocks with a `url` source) and bare
base64 (Anthropic `image` blocks, Ollama `images`). URLs are fetched by the API node, all of a
request's at once, behind the guard in image_fetch.py.

The API keeps only hashes in the command; the bytes go to the object store exo-images once
(a second send of the same image uploads nothing), and workers fetch them by hash. Images are
stored only for a request that can be served (`ImageUploads.stored`): one the master refuses leaves
nothing behind that it uploaded.
"""

from __future__ import annotations

import asyncio
import binascii
import io
import struct
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import msgspec
import PIL.Image

from exo.api.context import ApiContext
from exo.api.errors import ApiError
from exo.api.image_fetch import EVERYWHERE, ByteBudget, FetchLimits, ImageFetchError, fetch_image
from exo.bus.images import ImageStoreFull, delete_image, image_digest, store_image
from exo.core.ids import ModelId
from exo.core.requests import GenerationParams
from exo.core.state import State
from exo.settings.services import ApiSettings

MAX_ASPECT_RATIO = 200  # vision processors (Qwen2-VL's among them) refuse images more elongated than this

# What an image URL may be, on every surface.
URL_KINDS = "a base64 data: URL (data:image/png;base64,...) or an http(s) URL"
_PENDING = "url:"  # an http(s) image's place in the messages until it is fetched: no sha256 digest starts so
# Vision models (mlx-vlm) see images in user turns only: elsewhere they are refused before any is stored.
USER_ONLY = "images are taken in user messages only"


def check_image(data: bytes, param: str, name: str = "the image",
                max_pixels: int = ApiSettings().max_image_pixels) -> None:
    """Refuse, before anything is stored or a runner spends time on it, an image that cannot be
    decoded whole (a truncated PNG), that decodes to more than `max_pixels` (a 420 KB PNG of
    12000 x 12000 took a runner 15 s), or whose shape no vision processor takes: read from the
    header and the file's structure (PIL's verify), never by decoding the pixels. `name` says
    which image ("image 2 of the request") in the error."""
    try:
        with PIL.Image.open(io.BytesIO(data)) as image:
            width, height = image.size
            if width * height > max_pixels:
                raise ApiError(400, f"{name} is {width} x {height} pixels, over the limit of {max_pixels} "
                                    "(EXO_MAX_IMAGE_PIXELS): send it smaller", param=param)
            if max(width, height) > MAX_ASPECT_RATIO * min(width, height):
                raise ApiError(400, f"{name} is {width} x {height} pixels: its sides may differ at most "
                                    f"{MAX_ASPECT_RATIO} times", param=param)
            image.verify()
    except ApiError:
        raise
    except (PIL.UnidentifiedImageError, PIL.Image.DecompressionBombError):
        raise ApiError(400, f"{name} is not an image this model can read (PNG, JPEG, GIF, WebP, ...)",
                       param=param) from None
    except (OSError, SyntaxError, ValueError, struct.error) as error:  # PIL's ways of saying "broken"
        raise ApiError(400, f"{name} is damaged: {error}", param=param) from None


class ImageUploads:
    """The images of one request, decoded and hashed, waiting to be stored."""

    def __init__(self, limits: ApiSettings) -> None:
        self.by_digest: dict[str, bytes] = {}
        self._params: dict[str, str] = {}  # where in the request each image is, for errors that name it
        self._pending: dict[str, str] = {}  # http(s) URLs to fetch, each with where it first is in the request
        self._limits = limits
        self._max_bytes = limits.max_image_bytes

    def add_image_url(self, url: str, param: str) -> str:
        """An image URL: a base64 `data:` URL, decoded now (returns the image's digest), or an
        http(s) one, fetched by `with_fetched_images` (returns a placeholder it replaces)."""
        if url.partition(":")[0].lower() in ("http", "https"):
            self._pending.setdefault(url, param)
            self._check_count(param)
            return _PENDING + url
        if not url.startswith("data:"):
            raise ApiError(400, f"an image URL must be {URL_KINDS}", param=param)
        header, _, payload = url.partition(",")
        if not header.endswith(";base64"):
            raise ApiError(400, "image_url data: URL must be base64-encoded (data:image/png;base64,...)", param=param)
        return self.add_base64(payload, param)

    def add_base64(self, payload: str, param: str) -> str:
        """An image's bytes as bare base64 (Anthropic's `source.data`, Ollama's `images`), or a
        data: URL's payload. Returns the image's digest."""
        if not payload:
            raise ApiError(400, "the image is empty: send its bytes as base64", param=param)
        if len(payload) * 3 // 4 > self._max_bytes + 3:  # refused before decoding it
            raise ApiError(413, f"image larger than the limit of {self._max_bytes} bytes", param=param)
        try:
            data = binascii.a2b_base64(payload, strict_mode=True)  # twice as fast as b64decode(validate=True)
        except (binascii.Error, ValueError):
            raise ApiError(400, "the image is not valid base64", param=param) from None
        if len(data) > self._max_bytes:
            raise ApiError(413, f"image of {len(data)} bytes is larger than the limit of {self._max_bytes}", param=param)
        return self._add_bytes(data, param)

    def _add_bytes(self, data: bytes, param: str) -> str:
        digest = image_digest(data)
        self.by_digest[digest] = data
        self._params[digest] = param
        self._check_count(param)
        if sum(map(len, self.by_digest.values())) > self._limits.max_request_image_bytes:
            raise ApiError(413, f"the images of one request may total at most {self._limits.max_request_image_bytes} "
                                "bytes", param=param)
        return digest

    def _check_count(self, param: str) -> None:
        """Images decoded and URLs still to fetch together: so no more than the cap is ever fetched."""
        if len(self.by_digest) + len(self._pending) > self._limits.max_images:
            raise ApiError(400, f"at most {self._limits.max_images} images in one request", param=param)

    async def with_fetched_images(self, params: GenerationParams) -> GenerationParams:
        """`params` with every http(s) image fetched, concurrently (at most EXO_MAX_IMAGES of
        them), and its placeholder replaced by its digest. The first fetch that fails fails the
        request with a 400 naming where its URL is and why."""
        pending, self._pending = self._pending, {}  # each fetched image is counted in by_digest from now on
        if not pending:
            return params
        fetching = FetchLimits(self._max_bytes, self._limits.image_url_timeout_s,
                               EVERYWHERE if self._limits.image_url_private else ())
        budget = ByteBudget(self._limits.max_request_image_bytes - sum(map(len, self.by_digest.values())))
        try:
            async with asyncio.TaskGroup() as group:
                tasks = {url: group.create_task(self._fetch(url, param, fetching, budget))
                         for url, param in pending.items()}
        except ExceptionGroup as failed:
            raise failed.exceptions[0] from None
        digests = {_PENDING + url: task.result() for url, task in tasks.items()}
        messages = [msgspec.structs.replace(m, images=[digests.get(d, d) for d in m.images]) for m in params.messages]
        self.by_digest = {d: self.by_digest[d] for m in messages for d in m.images}  # request order, for "image N" in errors
        return msgspec.structs.replace(params, messages=messages)

    async def _fetch(self, url: str, param: str, limits: FetchLimits, budget: ByteBudget) -> str:
        try:
            data = await fetch_image(url, limits, budget)
        except ImageFetchError as error:
            raise ApiError(400, f"the image at {url[:200]} could not be fetched: {error}", param=param) from None
        return self._add_bytes(data, param)

    @asynccontextmanager
    async def stored(self, ctx: ApiContext, model_id: ModelId, param: str = "messages") -> AsyncIterator[None]:
        """Stores the images for the block, which queues the request. If the model takes no
        images or has no instance to serve it, nothing is stored; if the block raises (the master
        refused it), the images uploaded here are deleted again, unless a task in State took
        them meanwhile. Checked on entry, so an unknown model gets its surface's 404 first."""
        if not self.by_digest:
            yield
            return
        card = ctx.card(model_id)
        if card is not None and not card.supports_images:
            raise ApiError(400, f"the model {model_id!r} does not take image inputs", param=param)
        if not ctx.view.state.instances_of(model_id):
            raise ApiError(503, f"no instance of {model_id!r} is running; place one first", code="unavailable")
        for n, (digest, data) in enumerate(self.by_digest.items(), start=1):  # what the model will be given
            check_image(data, self._params[digest], f"image {n} of the request", self._limits.max_image_pixels)
        uploaded: list[str] = []
        try:
            for digest, data in self.by_digest.items():
                digest, new = await store_image(ctx.nc, data, digest)
                uploaded += [digest] if new else []
        except ImageStoreFull as full:
            await _delete_unused(ctx, uploaded)
            raise ApiError(507, str(full), code="insufficient_storage") from None
        try:
            yield
        except BaseException:
            await _delete_unused(ctx, uploaded)
            raise


async def _delete_unused(ctx: ApiContext, digests: list[str]) -> None:
    in_use = _images_of_open_tasks(ctx.view.state)
    for digest in digests:
        if digest not in in_use:
            await delete_image(ctx.nc, digest)


def _images_of_open_tasks(state: State) -> set[str]:
    return {digest for task in state.tasks.values() if task.status in ("pending", "running")
            for message in task.params.messages for digest in message.images}
