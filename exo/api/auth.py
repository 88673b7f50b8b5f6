"""API keys: with keys set, every route but /health and the dashboard's page and static files
needs `Authorization: Bearer <key>` (Anthropic clients send `x-api-key`, accepted on
/v1/messages). A wrong or missing key gets 401 in the surface's own error shape (see errors.py)."""

from __future__ import annotations

import hmac
import logging

from aiohttp import web
from aiohttp.typedefs import Handler

from exo.api.context import context_of
from exo.api.errors import ApiError

log = logging.getLogger(__name__)

OPEN_PATHS = frozenset({"/health", "/"})
# The dashboard's static files hold no cluster data; a browser cannot send a Bearer header when
# it loads a page, so the page is public and asks for the key itself for its data requests.
OPEN_PREFIXES = ("/dashboard/",)


def is_open_path(path: str) -> bool:
    return path in OPEN_PATHS or path.startswith(OPEN_PREFIXES)


@web.middleware
async def auth_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    keys = context_of(request).settings.api_keys
    if keys and not is_open_path(request.path) and not _key_matches(_presented_key(request), keys):
        raise ApiError(401, "a valid API key is required: send 'Authorization: Bearer <key>'",
                       code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
    return await handler(request)


def _presented_key(request: web.Request) -> str:
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    if request.path.startswith("/v1/messages"):
        return request.headers.get("x-api-key", "")
    return ""


def _key_matches(presented: str, keys: tuple[str, ...]) -> bool:
    # Compare against every key in constant time: how long it takes says nothing about the keys.
    matched = False
    for key in keys:
        matched |= hmac.compare_digest(presented.encode(), key.encode())
    return matched and bool(presented)
