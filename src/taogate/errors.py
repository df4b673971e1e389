"""Errors the gateway itself produces, rendered once, at the boundary, in OpenAI's error shape.

Upstream 4xx/5xx bodies are relayed unchanged; only errors that taogate decides are built here::

    GatewayError                      status  type                    code
    ├── Unauthorized                  401     authentication_error    invalid_api_key
    ├── BadRequest                    400     invalid_request_error   (given)
    │   └── BodyTooLarge              413     invalid_request_error   body_too_large
    ├── NotFound                      404     invalid_request_error   not_found / model_not_found
    ├── MethodNotAllowed              405     invalid_request_error   method_not_allowed
    ├── Overloaded                    429     rate_limit_error        queue_full / queue_timeout
    ├── NoInstance                    503     service_unavailable     no_instance
    └── UpstreamError                 502/504 upstream_error          upstream_unreachable / upstream_timeout

Each error knows its status, its OpenAI ``type`` and ``code``, and an optional ``Retry-After``.
"""

from __future__ import annotations

import orjson


class GatewayError(Exception):
    status: int = 500
    type: str = "internal_error"
    code: str = "internal_error"

    def __init__(
        self,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        retry_after: int | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code
        self.param = param
        self.retry_after = retry_after

    def body(self) -> bytes:
        return error_body(self.message, self.type, self.code, self.param)

    def headers(self) -> list[tuple[bytes, bytes]]:
        out = [(b"content-type", b"application/json")]
        if self.retry_after is not None:
            out.append((b"retry-after", str(self.retry_after).encode()))
        return out


class Unauthorized(GatewayError):
    status = 401
    type = "authentication_error"
    code = "invalid_api_key"


class BadRequest(GatewayError):
    status = 400
    type = "invalid_request_error"
    code = "invalid_request"


class BodyTooLarge(BadRequest):
    status = 413
    code = "body_too_large"


class NotFound(GatewayError):
    status = 404
    type = "invalid_request_error"
    code = "not_found"


class MethodNotAllowed(GatewayError):
    status = 405
    type = "invalid_request_error"
    code = "method_not_allowed"


class Overloaded(GatewayError):
    status = 429
    type = "rate_limit_error"
    code = "queue_full"


class NoInstance(GatewayError):
    status = 503
    type = "service_unavailable"
    code = "no_instance"


class UpstreamError(GatewayError):
    status = 502
    type = "upstream_error"
    code = "upstream_unreachable"


class UpstreamTimeout(UpstreamError):
    status = 504
    code = "upstream_timeout"


def error_body(message: str, type_: str, code: str | None, param: str | None = None) -> bytes:
    """OpenAI's error JSON: ``{"error": {"message", "type", "param", "code"}}``."""
    return orjson.dumps({"error": {"message": message, "type": type_, "param": param, "code": code}})


def sse_error_event(message: str, code: str) -> bytes:
    """The event that ends a stream the gateway could not finish (mid-stream upstream failure)."""
    payload = orjson.dumps(
        {"error": {"message": message, "type": "upstream_error", "param": None, "code": code}}
    )
    return b"data: " + payload + b"\n\ndata: [DONE]\n\n"
