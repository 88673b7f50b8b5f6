"""Ctrl-C stops a node promptly even while a client holds a stream open (a dashboard's /events):
aiohttp's default gave each open stream 60 s per shutdown step (122 s measured before)."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from tests.support.exo_process import ExoProcess

pytestmark = pytest.mark.slow


def test_ctrl_c_stops_a_node_with_an_open_event_stream_within_seconds(tmp_path):
    node = ExoProcess(tmp_path / "node", {}, ["--no-worker"]).start()
    opened = threading.Event()

    def follow() -> None:
        try:
            with httpx.stream("GET", f"{node.url}/events", timeout=None) as stream:
                opened.set()
                for _ in stream.iter_bytes():
                    pass
        except httpx.HTTPError:
            pass  # the node went away: what this test wants

    threading.Thread(target=follow, daemon=True).start()
    assert opened.wait(30)
    started = time.monotonic()
    assert node.interrupt(timeout=60) == 0
    assert time.monotonic() - started < 15
