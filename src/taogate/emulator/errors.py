"""Errors in vLLM's OpenAI-compatible shape: ``{"error": {"message", "type", "param", "code"}}``.

Every failure the emulator reports is an ``ApiError`` raised where it is detected and rendered once, in
the ASGI layer. vLLM has two kinds of 400: request validation (FastAPI and pydantic, before the
request reaches the engine: bad JSON, a wrong type, a missing body field, a missing Content-Type),
typed ``"Bad Request"`` with a message opening ``1 validation error:`` and a ``param`` such as
``body.max_tokens``; and the engine's own checks, typed ``BadRequestError`` with a plain ``param``.
``code`` repeats the HTTP status as an integer, which is what the OpenAI SDK maps to its exceptions.
"""

from __future__ import annotations

import orjson

__all__ = ["VALIDATION_TYPE", "ApiError", "bad_request", "error_body", "validation_error"]

_TYPES = {
    400: "BadRequestError",
    404: "NotFoundError",
    405: "MethodNotAllowed",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}
VALIDATION_TYPE = "Bad Request"


def error_body(status: int, message: str, param: str | None = None, kind: str | None = None) -> bytes:
    error = {"message": message, "type": kind or _TYPES.get(status, "Error"), "param": param, "code": status}
    return orjson.dumps({"error": error})


class ApiError(Exception):
    """A request the emulator answers with an error status and vLLM's error body."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.kind = kind

    def body(self) -> bytes:
        return error_body(self.status, self.message, self.param, self.kind)


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param)


def validation_error(detail: str, param: str | None) -> ApiError:
    """A request-validation 400 as vLLM's FastAPI layer renders it (``detail``: the one error)."""
    return ApiError(400, f"1 validation error:\n  {detail}", param, VALIDATION_TYPE)
