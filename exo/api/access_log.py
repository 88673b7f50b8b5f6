"""The HTTP access log: one line per request, on logger `aiohttp.access`. DEBUG unless EXO_ACCESS_LOG
is on (then INFO): a busy node's INFO log tells its lifecycle, not its traffic."""

from __future__ import annotations

import logging
from typing import Any

from aiohttp import web
from aiohttp.abc import AbstractAccessLogger

ACCESS_LOGGER = logging.getLogger("aiohttp.access")


class QuietAccessLog(AbstractAccessLogger):
    """Method, path (never the query: it may carry secrets), status and seconds, with each as a field."""

    level = logging.DEBUG

    def log(self, request: web.BaseRequest, response: web.StreamResponse, time: float) -> None:
        self.logger.log(self.level, "%s %s %s %d %.3f s", request.remote, request.method, request.path,
                        response.status, time, extra={"remote": request.remote, "method": request.method,
                                                      "path": request.path, "status": response.status,
                                                      "seconds": round(time, 3)})

    @property
    def enabled(self) -> bool:
        return self.logger.isEnabledFor(self.level)  # no line to format when nobody would see it


class LoudAccessLog(QuietAccessLog):
    level = logging.INFO


def app_runner(app: web.Application, access_log: bool, **kwargs: Any) -> web.AppRunner:
    """The API's AppRunner, its access log at INFO when `access_log` (EXO_ACCESS_LOG), else at DEBUG."""
    return web.AppRunner(app, access_log=ACCESS_LOGGER, access_log_class=LoudAccessLog if access_log else QuietAccessLog,
                         **kwargs)
