"""The body of every API error, OpenAI-shaped: ``{"error": {"message", "type", "param", "code"}}``.

Shared by the API (``specops.serving.http.api``) and the read deadlines (``specops.serving.http.read_timeouts``,
which answer a 408 before any route runs), so neither imports the other.
"""

from __future__ import annotations

from specops.core.errors import clip

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable",
    504: "timeout",
}


def error_body(status: int, message: str, code: str, param: str | None = None) -> dict:
    return {
        "error": {
            "message": _printable(message, 1000),
            "type": ERROR_TYPES.get(status, "server_error"),
            "param": None if param is None else _printable(param, 200),
            "code": code,
        }
    }


def _printable(text: str, limit: int) -> str:
    """A backstop for what an error quotes: bounded, and encodable (a lone surrogate is written as ``\\udXXX``)."""
    return clip(text, limit).encode("utf-8", "backslashreplace").decode("utf-8")
