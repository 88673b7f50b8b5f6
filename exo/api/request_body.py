"""Decoding JSON request bodies into Structs, with OpenAI-style 400s for every way it can fail."""

from __future__ import annotations

import difflib
from typing import TypeVar

import msgspec
from aiohttp import web

from exo.api.context import context_of
from exo.api.errors import ApiError

T = TypeVar("T")

async def decode_body(request: web.Request, kind: type[T]) -> T:
    raw = await read_body(request, context_of(request).body_limit())
    if not raw:
        raise ApiError(400, "the request body is empty; send a JSON object")
    try:
        return msgspec.json.decode(raw, type=kind)
    except msgspec.ValidationError as error:
        raise ApiError(400, f"invalid request body: {error}{field_hint(str(error), kind)}",
                       param=_path_of(str(error))) from None
    except msgspec.DecodeError as error:
        raise ApiError(400, f"the request body is not valid JSON: {error}") from None
    except RecursionError:
        raise ApiError(400, "the request body is nested too deeply") from None


async def read_body(request: web.Request, limit: int) -> bytes:
    """The whole body, or a 413 naming `limit` as soon as the body is known to be larger: by its
    Content-Length before any of it is read, else (chunked) once more than that has come."""
    if request.content_length is not None and request.content_length > limit:
        raise body_too_large(limit)
    body = bytearray()
    async for chunk in request.content.iter_any():
        body += chunk
        if len(body) > limit:
            raise body_too_large(limit)
    return bytes(body)


def body_too_large(limit: int) -> ApiError:
    return ApiError(413, f"the request body is larger than this server's limit of {limit} bytes (EXO_MAX_BODY_BYTES; "
                         "by default what one NATS message carries: the server's max_payload less 64 KiB)",
                    code="request_too_large")


def field_hint(message: str, kind: type) -> str:
    """"; did you mean `model_id`?" for an unknown top-level field close to one the body has."""
    if not message.startswith("Object contains unknown field `") or "- at `$." in message:
        return ""  # not an unknown field, or a nested one: the outer body's fields are no guide
    unknown = message.split("`", 2)[1]
    fields = getattr(kind, "__struct_fields__", ())
    near = difflib.get_close_matches(unknown, fields, n=1, cutoff=0.6)
    return f"; did you mean `{near[0]}`?" if near else f"; the fields are: {', '.join(fields)}" if fields else ""


def _path_of(message: str) -> str | None:
    # msgspec ends its messages with "- at `$.field[0]`"
    if "at `$." in message:
        return message.rsplit("at `$.", 1)[1].rstrip("`")
    if "missing required field `" in message:
        return message.split("missing required field `", 1)[1].split("`", 1)[0]
    return None
