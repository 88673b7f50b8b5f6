"""The dashboard at GET /: plain HTML, CSS and JavaScript modules shipped inside the package.

Nodes run without internet access, so nothing comes from a CDN and nothing is built at run
time: the browser loads the files in `static/` as they are. The page and its files hold no
cluster data, so they are public even with API keys; the page asks for a key and sends it on
every data request (see static/api.js).
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

from aiohttp import web

STATIC_DIR = Path(__file__).parent / "static"
STATIC_PREFIX = "/dashboard/"
# Only flat, plainly named files of these kinds: a request can never reach outside STATIC_DIR.
_FILE_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]*\.(js|css|svg)$")
_CONTENT_TYPES = {"js": "text/javascript", "css": "text/css", "svg": "image/svg+xml"}
VENDOR_DIR = STATIC_DIR / "vendor"  # libraries as their authors ship them, under their own names (README there)
_VENDOR_FILE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*\.(js|css)$")


def add_routes(router: web.UrlDispatcher) -> None:
    router.add_get("/", index)
    router.add_get(STATIC_PREFIX + "{name}", static_file)
    router.add_get(STATIC_PREFIX + "vendor/{name}", vendor_file)


async def index(request: web.Request) -> web.Response:
    return _serve(request, STATIC_DIR / "index.html", "text/html")


async def static_file(request: web.Request) -> web.Response:
    return _named_file(request, STATIC_DIR, _FILE_NAME, "")


async def vendor_file(request: web.Request) -> web.Response:
    return _named_file(request, VENDOR_DIR, _VENDOR_FILE, "vendor/")


def _named_file(request: web.Request, directory: Path, allowed: re.Pattern[str], shown_as: str) -> web.Response:
    """The file `name` in `directory`, if its name matches `allowed` (no path separators, a known type)."""
    name = request.match_info["name"]
    match = allowed.match(name)
    path = directory / name
    if match is None or not path.is_file():
        raise web.HTTPNotFound(text=f"no dashboard file {shown_as}{name!r}")
    return _serve(request, path, _CONTENT_TYPES[match.group(1)])


def _serve(request: web.Request, path: Path, content_type: str) -> web.Response:
    # The browser revalidates every time and the ETag is the content's hash, not the file's
    # mtime and size (wheels pin mtimes): after an upgrade it never mixes old modules with new.
    # The files are a few KB, so reading and hashing them per request costs nothing that matters.
    body = path.read_bytes()
    etag = f'"{hashlib.sha256(body).hexdigest()[:20]}"'
    headers = {"Cache-Control": "no-cache", "ETag": etag}
    if request.headers.get("If-None-Match") == etag:
        return web.Response(status=304, headers=headers)
    return web.Response(body=body, content_type=content_type, charset="utf-8", headers=headers)
