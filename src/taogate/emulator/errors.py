"""Errors in vLLM's OpenAI-compatible shape: ``{"error": {"message", "type", "param", "code"}}``.

Every failure the emulator reports is an ``ApiError`` raised where it is detected and rendered once, in
the ASGI layer. ``type`` follows vLLM's naming (``BadRequestError``, ``NotFoundError``, ...) and ``code``
repeats the HTTP status as an integer, which is what the OpenAI SDK maps to its exception classes.
"""

from __future__ import annotations

import orjson

__all__ = ["ApiError", "bad_request", "error_body"]

_TYPES = {
    400: "BadRequestError",
    404: "NotFoundError",
    405: "MethodNotAllowed",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


def error_body(status: int, message: str, param: str | None = None) -> bytes:
    error = {"message": message, "type": _TYPES.get(status, "Error"), "param": param, "code": status}
    return orjson.dumps({"error": error})


class ApiError(Exception):
    """A request the emulator answers with an error status and vLLM's error body."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param

    def body(self) -> bytes:
        return error_body(self.status, self.message, self.param)


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param)
