"""Errors in each surface's own JSON shape, with the right status.

OpenAI (and the cluster routes): {"error": {"message", "type", "param", "code"}}.
Anthropic (/v1/messages): {"type": "error", "error": {"type", "message"}}.
Ollama (/api/*): {"error": "message"}.
"""

from __future__ import annotations

import logging
from typing import Any

from aiohttp import web
from aiohttp.typedefs import Handler

from exo.core.types import RejectionCode

log = logging.getLogger(__name__)

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error", 409: "conflict_error",
          413: "invalid_request_error", 429: "rate_limit_error", 503: "service_unavailable", 504: "timeout_error",
          500: "internal_error", 507: "service_unavailable"}
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}

STATUS_FOR_REJECTION: dict[RejectionCode, int] = {
    "invalid": 400, "not_found": 404, "conflict": 409, "unavailable": 503, "overloaded": 429, "rate_limited": 429,
    "unauthorized": 403,
}


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def response(self, path: str = "") -> web.Response:
        return error_response(self.status, self.message, self.param, self.code, path=path, headers=self.headers)


def surface_of(path: str) -> str:
    if path.startswith("/v1/messages"):
        return "anthropic"
    if path.startswith("/api/"):
        return "ollama"
    return "openai"


def error_body(status: int, message: str, param: str | None = None, code: str | None = None, path: str = "") -> dict[str, Any]:
    surface = surface_of(path)
    if surface == "anthropic":
        return {"type": "error", "error": {"type": _ANTHROPIC_TYPES.get(status, "api_error"), "message": message}}
    if surface == "ollama":
        return {"error": message}
    return {"error": {"message": message, "type": _TYPES.get(status, "invalid_request_error"), "param": param, "code": code}}


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   path: str = "", headers: dict[str, str] | None = None) -> web.Response:
    return web.json_response(error_body(status, message, param, code, path), status=status, headers=headers)


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except ApiError as error:
        return error.response(request.path)
    except web.HTTPException as error:
        if error.status < 400:
            raise
        text = error.text if error.text and not error.text.startswith(str(error.status)) else (error.reason or "error")
        return error_response(error.status, text, path=request.path)
    except Exception as error:  # a bug must still answer in the API's shape and keep the node serving
        log.exception("unhandled error on %s %s", request.method, request.path)
        return error_response(500, f"internal error: {type(error).__name__}", path=request.path)
