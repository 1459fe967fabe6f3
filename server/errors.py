"""Errors a client sees: each API's own JSON error shape, never a traceback.

:class:`ApiError` is raised anywhere in a handler; the app turns it into the OpenAI shape
``{"error": {"message", "type", "param", "code"}}`` or, on the Anthropic route, into
``{"type": "error", "error": {"type", "message"}}``.
"""

from __future__ import annotations

from typing import Any

# HTTP status -> (OpenAI error type, Anthropic error type)
_TYPES = {
    400: ("invalid_request_error", "invalid_request_error"),
    401: ("authentication_error", "authentication_error"),
    404: ("not_found_error", "not_found_error"),
    405: ("invalid_request_error", "invalid_request_error"),
    413: ("invalid_request_error", "request_too_large"),
    415: ("invalid_request_error", "invalid_request_error"),
    429: ("rate_limit_error", "rate_limit_error"),
    500: ("server_error", "api_error"),
    503: ("server_error", "overloaded_error"),
}


class ApiError(Exception):
    """A request that is answered with an error: HTTP ``status`` and a message that says
    what was wrong (``param``: the offending field, when there is one)."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code


def openai_body(err: ApiError) -> dict[str, Any]:
    kind = _TYPES.get(err.status, ("invalid_request_error" if err.status < 500 else "server_error",))[0]
    return {"error": {"message": err.message, "type": kind, "param": err.param, "code": err.code}}


def anthropic_body(err: ApiError) -> dict[str, Any]:
    pair = _TYPES.get(err.status)
    kind = pair[1] if pair else ("invalid_request_error" if err.status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": err.message}}
