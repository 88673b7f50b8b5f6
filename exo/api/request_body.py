"""Decoding JSON request bodies into Structs, with OpenAI-style 400s for every way it can fail."""

from __future__ import annotations

import os
from typing import TypeVar

import msgspec
from aiohttp import web

from exo.api.errors import ApiError

T = TypeVar("T")

MAX_BODY_BYTES = int(os.environ.get("EXO_MAX_BODY_BYTES", str(128 * 1024 * 1024)))  # images ride in bodies, base64


async def decode_body(request: web.Request, kind: type[T]) -> T:
    raw = await request.read()
    if not raw:
        raise ApiError(400, "the request body is empty; send a JSON object")
    try:
        return msgspec.json.decode(raw, type=kind)
    except msgspec.ValidationError as error:
        raise ApiError(400, f"invalid request body: {error}", param=_path_of(str(error))) from None
    except msgspec.DecodeError as error:
        raise ApiError(400, f"the request body is not valid JSON: {error}") from None
    except RecursionError:
        raise ApiError(400, "the request body is nested too deeply") from None


def _path_of(message: str) -> str | None:
    # msgspec ends its messages with "- at `$.field[0]`"
    if "at `$." in message:
        return message.rsplit("at `$.", 1)[1].rstrip("`")
    if "missing required field `" in message:
        return message.split("missing required field `", 1)[1].split("`", 1)[0]
    return None
