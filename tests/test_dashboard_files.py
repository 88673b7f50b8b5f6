"""The dashboard's files at GET / and /dashboard/, served in process (no exo, no browser): every
file the page loads, with its type and a content-hash ETag, public under API keys (they hold no
cluster data); nothing else is served."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
from aiohttp.test_utils import TestClient, TestServer

from exo.api.app import build_app
from exo.api.context import ApiContext
from exo.api.dashboard import STATIC_DIR
from exo.core.state import State
from exo.settings.services import ApiSettings
from tests.support.dashboard import KEY


def app_client(keys: frozenset[str]) -> TestClient:
    # Only the dashboard routes and the key check run here: nothing touches NATS, and State has no keys.
    ctx = ApiContext(nc=None, view=SimpleNamespace(state=State()), outcomes=None,  # type: ignore[arg-type]
                     builtin_cards={}, node_id="", data_dir=Path("."),
                     settings=ApiSettings(api_keys=tuple(keys)))
    return TestClient(TestServer(build_app(ctx)))


def referenced_files() -> set[str]:
    """Every file the page loads: index.html's links, then the modules' imports, transitively."""
    html = (STATIC_DIR / "index.html").read_text()
    found = set(re.findall(r'(?:href|src)="/dashboard/([^"]+)"', html))
    queue = [name for name in found if name.endswith(".js")]
    while queue:
        for name in re.findall(r'from "\./([^"]+)"', (STATIC_DIR / queue.pop()).read_text()):
            if name not in found:
                found.add(name)
                queue.append(name)
    return found


async def test_every_file_the_page_loads_is_served_with_its_type_and_without_a_key():
    files = referenced_files()
    assert {"app.css", "main.js", "api.js", "live.js", "chat.js", "events.js", "instances.js", "status.js", "names.js",
            "rates.js"} <= files
    async with app_client(frozenset({KEY})) as client:
        page = await client.get("/")
        assert page.status == 200 and page.content_type == "text/html"
        assert page.headers["Cache-Control"] == "no-cache"
        assert '<script type="module" src="/dashboard/main.js">' in await page.text()
        for name in sorted(files):
            response = await client.get(f"/dashboard/{name}")
            assert response.status == 200, name
            assert response.content_type == ("text/css" if name.endswith(".css") else "text/javascript"), name
            body = (STATIC_DIR / name).read_bytes()
            assert await response.read() == body
            # Revalidation by the content's hash: unchanged files cost a 304, changed ones never do.
            etag = response.headers["ETag"]
            assert etag == f'"{hashlib.sha256(body).hexdigest()[:20]}"'
            assert (await client.get(f"/dashboard/{name}", headers={"If-None-Match": etag})).status == 304
            assert (await client.get(f"/dashboard/{name}", headers={"If-None-Match": '"stale"'})).status == 200
        # The data stays behind the key.
        assert (await client.get("/state")).status == 401
        assert (await client.get("/events")).status == 401


@pytest.mark.parametrize("path", ["/dashboard/index.html", "/dashboard/nothing.js", "/dashboard/..%2F__init__.py",
                                  "/dashboard/.hidden.js", "/dashboard/", "/dashboard/%2e%2e%2fauth.py"])
async def test_nothing_but_the_static_files_is_served(path):
    async with app_client(frozenset()) as client:
        response = await client.get(path)
        assert response.status == 404, path
        assert "import" not in await response.text()  # no source file leaked
