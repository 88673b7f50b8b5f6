"""What the dashboard's browser tests share: a real `exo` node on the fake Hub with an API key,
headless Chromium on it, and the key prompt answered."""

from __future__ import annotations

import os
import time
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
NODE_LOG_LINES = 40


def require_browser() -> None:
    if CHROMIUM.exists():
        return
    message = f"{CHROMIUM} is missing: apt-get install chromium (Debian's package)"
    if os.environ.get("EXO_REQUIRE_BROWSER") == "1":
        pytest.fail(message)
    pytest.skip(message)


@contextmanager
def exo_node(root: Path, repos: dict[str, Path], env: dict[str, str] | None = None) -> Iterator[ExoProcess]:
    """An exo process that asks for KEY, its (fake) Hub serving `repos`, with `env` added; Ctrl-C at the end."""
    require_browser()
    with FakeHub(repos) as hub:
        exo = start_exo(root, hub, {"EXO_API_KEYS": KEY} | (env or {}))
        try:
            yield exo
        finally:
            if exo.process is not None and exo.process.poll() is None:
                exo.interrupt()


@contextmanager
def chromium_page(profile: Path) -> Iterator[Any]:
    """A page in headless Chromium; `page.errors` collects uncaught exceptions of its scripts, and
    `page.seen` its console, failed requests and answers other than 2xx, for what_the_page_saw."""
    require_browser()
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        context = playwright.chromium.launch_persistent_context(
            str(profile), executable_path=str(CHROMIUM), args=CHROMIUM_ARGS, headless=True,
            viewport={"width": 1440, "height": 1000})
        context.set_default_timeout(30_000)
        page: Any = context.pages[0] if context.pages else context.new_page()  # a Page, given `errors` below
        _watch(page)
        try:
            yield page
        finally:
            context.close()


def _watch(page: Any) -> None:
    # A module script that fails to load raises no pageerror, and a fetch that never ends shows
    # nowhere: the failed requests and those still unanswered are what tell those apart.
    started = time.monotonic()
    page.errors, page.seen, page.unanswered = [], [], {}

    def note(line: str) -> None:
        page.seen.append(f"{time.monotonic() - started:6.2f} s {line}")

    def answered(response: Any) -> None:
        page.unanswered.pop(response.request, None)
        if not response.ok:
            note(f"{response.status} {response.request.method} {response.url}")

    def failed(request: Any) -> None:
        page.unanswered.pop(request, None)
        note(f"failed {request.method} {request.url}: {request.failure}")

    def sent(request: Any) -> None:
        page.unanswered[request] = f"{time.monotonic() - started:6.2f} s {request.method} {request.url}"

    def uncaught(error: Any) -> None:
        page.errors.append(str(error))
        note(f"page error: {error}")

    def logged(message: Any) -> None:
        if message.type != "verbose":  # Chromium's DOM advice ("password forms should have...")
            note(f"console {message.type}: {message.text}")

    page.on("pageerror", uncaught)
    page.on("console", logged)
    page.on("request", sent)
    page.on("response", answered)
    page.on("requestfailed", failed)


def what_the_page_saw(page: Any, node: ExoProcess | None = None) -> str:
    """The page's errors, console, failed or refused requests, requests still unanswered (sent at),
    and the node's last log lines: the message of an assertion about a page that did not behave."""
    parts = [f"page at {page.url}; what it saw (seconds since the browser opened):",
             *(page.seen or ["(no error, console message or request other than 2xx)"]),
             "requests unanswered:", *(page.unanswered.values() or ["(none)"])]
    if node is not None:
        parts += [f"the node's log, last {NODE_LOG_LINES} lines:", *node.output().splitlines()[-NODE_LOG_LINES:]]
    return "\n".join(parts)


def shown(page: Any, node: ExoProcess | None, selector: str, state: str = "visible") -> None:
    """Wait for `selector` to be in `state`; if it never is, fail with what_the_page_saw."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeoutError

    try:
        page.locator(selector).wait_for(state=state)
    except PlaywrightTimeoutError as error:
        raise AssertionError(f"{error.message}\n{what_the_page_saw(page, node)}") from None


def answer_the_key_prompt(page: Any, node: ExoProcess | None, key: str = KEY,
                          ready: str = '#conn[data-state="live"]') -> None:
    """Wait for the key prompt, give `key`; returns once `ready` shows (an admin's page: it follows /events)."""
    shown(page, node, "#key-dialog")
    page.fill("#key-input", key)
    page.press("#key-input", "Enter")
    shown(page, node, "#key-dialog", "hidden")
    shown(page, node, ready)


def open_with_key(page: Any, node: ExoProcess) -> None:
    """Load the dashboard and answer its key prompt; returns once it follows /events."""
    page.goto(node.url)
    answer_the_key_prompt(page, node)
