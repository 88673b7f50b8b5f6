"""OpenAI-style JSON errors: {"error": {"message", "type", "param", "code"}} with the right status."""

from __future__ import annotations

import logging

from aiohttp import web

from exo.core.types import RejectionCode

log = logging.getLogger(__name__)

_TYPES = {400: "invalid_request_error", 404: "not_found_error", 409: "conflict_error", 413: "invalid_request_error",
          429: "rate_limit_error", 503: "service_unavailable", 504: "timeout_error", 500: "internal_error"}

STATUS_FOR_REJECTION: dict[RejectionCode, int] = {"invalid": 400, "not_found": 404, "conflict": 409, "unavailable": 503}


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def response(self) -> web.Response:
        return error_response(self.status, self.message, self.param, self.code)


def error_response(status: int, message: str, param: str | None = None, code: str | None = None) -> web.Response:
    body = {"error": {"message": message, "type": _TYPES.get(status, "invalid_request_error"), "param": param, "code": code}}
    return web.json_response(body, status=status)


@web.middleware
async def error_middleware(request: web.Request, handler):
    try:
        return await handler(request)
    except ApiError as error:
        return error.response()
    except web.HTTPException as error:
        if error.status < 400:
            raise
        return error_response(error.status, error.text if error.text and not error.text.startswith(str(error.status)) else (error.reason or "error"))
    except Exception as error:  # a bug must still answer in the API's shape and keep the node serving
        log.exception("unhandled error on %s %s", request.method, request.path)
        return error_response(500, f"internal error: {type(error).__name__}")
