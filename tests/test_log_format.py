"""EXO_LOG_FORMAT=json gives one JSON object per line with the line's ids as fields (exo/log_format.py);
EXO_ACCESS_LOG puts the per-request lines at INFO, else they are DEBUG (exo/api/access_log.py)."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import textwrap

import aiohttp
import pytest
from aiohttp import web

from exo.api.access_log import app_runner
from exo.log_format import JsonFormatter

CREATED = 1704164645.678  # 2024-01-02T03:04:05.678Z


def record(message: str, *args: object, extra: dict[str, object] | None = None, exc: bool = False) -> logging.LogRecord:
    logger = logging.getLogger("exo.master.service")
    exc_info = None
    if exc:
        try:
            raise ValueError("bad shard")
        except ValueError:
            exc_info = sys.exc_info()
    made = logger.makeRecord(logger.name, logging.INFO, "x.py", 1, message, args, exc_info, extra=extra)
    made.created = CREATED
    return made


def test_a_line_is_one_object_with_time_level_logger_node_message_and_its_ids():
    line = JsonFormatter("studio:52416").format(record("master: placed %s on %s", "org/m", "mini",
                                                       extra={"model": "org/m", "instance_id": "i-1"}))
    assert json.loads(line) == {"time": "2024-01-02T03:04:05.678Z", "level": "INFO", "logger": "exo.master.service",
                                "node": "studio:52416", "message": "master: placed org/m on mini",
                                "model": "org/m", "instance_id": "i-1"}


def test_a_multi_line_message_and_its_traceback_stay_on_one_line():
    line = JsonFormatter("n1").format(record("two\nlines", exc=True))
    assert "\n" not in line
    fields = json.loads(line)
    assert fields["message"] == "two\nlines"
    assert fields["exception"].startswith("Traceback (most recent call last):")
    assert fields["exception"].endswith("ValueError: bad shard")


def test_the_node_logs_json_when_exo_log_format_says_so():
    """exo/main.py's setup, as a node starts: its settings choose the format and name the node."""
    script = textwrap.dedent("""
        import logging
        from exo.main import parse_args
        parse_args([], {"EXO_LOG_FORMAT": "json", "EXO_NODE_NAME": "studio", "EXO_HOME": "/nonexistent"})
        logging.getLogger("exo.test").info("hello %s", "there", extra={"node_id": "n1"})
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    fields = json.loads(lines[0])
    assert fields.pop("time").endswith("Z")
    assert fields == {"level": "INFO", "logger": "exo.test", "node": "studio", "message": "hello there",
                      "node_id": "n1"}


async def models(request: web.Request) -> web.Response:
    return web.json_response({"data": []})


async def requested(access_log: bool) -> None:
    """One GET through the API's AppRunner; its cleanup waits for the request's access line."""
    app = web.Application()
    app.router.add_get("/v1/models", models)
    runner = app_runner(app, access_log)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]  # started: it has sockets
    try:
        async with aiohttp.ClientSession() as http, http.get(f"http://127.0.0.1:{port}/v1/models?key=x") as answer:
            assert answer.status == 200
    finally:
        await runner.cleanup()


def access_lines(caplog: pytest.LogCaptureFixture) -> list[tuple[str, str]]:
    return [(r.levelname, r.getMessage().split(" ", 1)[1].rsplit(" ", 2)[0])
            for r in caplog.records if r.name == "aiohttp.access"]


async def test_requests_are_not_logged_at_info_by_default_only_at_debug(caplog: pytest.LogCaptureFixture):
    with caplog.at_level(logging.INFO):
        await requested(access_log=False)
    assert access_lines(caplog) == []
    with caplog.at_level(logging.DEBUG):
        await requested(access_log=False)
    assert access_lines(caplog) == [("DEBUG", "GET /v1/models 200")]  # the path, never its query


async def test_exo_access_log_puts_one_info_line_per_request(caplog: pytest.LogCaptureFixture):
    with caplog.at_level(logging.INFO):
        await requested(access_log=True)
    assert access_lines(caplog) == [("INFO", "GET /v1/models 200")]
    assert caplog.records[-1].status == 200  # type: ignore[attr-defined]  # a field of JSON lines
