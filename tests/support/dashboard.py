"""What the dashboard's browser tests share: a real `exo` node on the fake Hub with an API key,
headless Chromium on it, and the key prompt answered."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from tests.support.e2e import start_exo
from tests.support.exo_process import ExoProcess
from tests.support.fake_hub import FakeHub

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
KEY = "dashboard-test-key"


def require_browser() -> None:
    if CHROMIUM.exists():
        return
    message = f"{CHROMIUM} is missing: apt-get install chromium (Debian's package)"
    if os.environ.get("EXO_REQUIRE_BROWSER") == "1":
        pytest.fail(message)
    pytest.skip(message)


@contextmanager
def exo_node(root: Path, repos: dict[str, Path]) -> Iterator[ExoProcess]:
    """An exo process that asks for KEY, its (fake) Hub serving `repos`; Ctrl-C at the end."""
    require_browser()
    with FakeHub(repos) as hub:
        exo = start_exo(root, hub, {"EXO_API_KEYS": KEY})
        try:
            yield exo
        finally:
            if exo.process is not None and exo.process.poll() is None:
                exo.interrupt()


@contextmanager
def chromium_page(profile: Path) -> Iterator[Any]:
    """A page in headless Chromium; `page.errors` collects uncaught exceptions of its scripts."""
    require_browser()
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        context = playwright.chromium.launch_persistent_context(
            str(profile), executable_path=str(CHROMIUM), args=CHROMIUM_ARGS, headless=True,
            viewport={"width": 1440, "height": 1000})
        context.set_default_timeout(30_000)
        page: Any = context.pages[0] if context.pages else context.new_page()  # a Page, given `errors` below
        page.errors = []
        page.on("pageerror", lambda error: page.errors.append(str(error)))
        try:
            yield page
        finally:
            context.close()


def open_with_key(page: Any, url: str) -> None:
    """Load the dashboard and answer its key prompt; returns once it follows /events."""
    page.goto(url)
    page.fill("#key-input", KEY)
    page.press("#key-input", "Enter")
    page.wait_for_selector('#conn[data-state="live"]')
