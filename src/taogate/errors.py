"""Errors the gateway itself produces, rendered once, at the boundary, in OpenAI's error shape.

Upstream 4xx/5xx bodies are relayed unchanged; only errors that taogate decides are built here::

    GatewayError                      status  type                    code
    │                                 500     internal_error          internal_error
    ├── Unauthorized                  401     authentication_error    invalid_api_key
    ├── BadRequest                    400     invalid_request_error   (given)
    │   ├── RequestTimeout            408     invalid_request_error   body_timeout
    │   ├── BodyTooLarge              413     invalid_request_error   body_too_large
    │   └── UnsupportedEncoding       415     invalid_request_error   unsupported_content_encoding
    ├── NotFound                      404     invalid_request_error   not_found / model_not_found
    ├── MethodNotAllowed              405     invalid_request_error   method_not_allowed
    ├── Overloaded                    429     rate_limit_error        queue_full / queue_timeout / shed
    ├── NoInstance                    503     service_unavailable     no_instance
    └── UpstreamError                 502     upstream_error          upstream_unreachable /
        │                                                             upstream_response_too_large
        └── UpstreamTimeout           504     upstream_error          upstream_timeout

Each error knows its status, its OpenAI ``type`` and ``code``, an optional ``Retry-After``, and
whether the connection must close after it (a body left unread or half read). How a path renders
them is its ``ErrorShape``: OpenAI's, unless the path is under a route of another API family.
"""

from __future__ import annotations

from typing import Any

import orjson


class GatewayError(Exception):
    status: int = 500
    type: str = "internal_error"
    code: str = "internal_error"
    closes: bool = False  # answer with connection: close (the rest of the request is not read)

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
        if self.closes:
            out.append((b"connection", b"close"))
        return out


class Unauthorized(GatewayError):
    status = 401
    type = "authentication_error"
    code = "invalid_api_key"


class BadRequest(GatewayError):
    status = 400
    type = "invalid_request_error"
    code = "invalid_request"


class RequestTimeout(BadRequest):
    status = 408
    code = "body_timeout"
    closes = True


class BodyTooLarge(BadRequest):
    status = 413
    code = "body_too_large"
    closes = True


class UnsupportedEncoding(BadRequest):
    """A body in a content coding the gateway does not decode (it reads bodies as plain JSON)."""

    status = 415
    code = "unsupported_content_encoding"

    def headers(self) -> list[tuple[bytes, bytes]]:
        return [*super().headers(), (b"accept-encoding", b"identity")]


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


def stream_error(message: str, code: str) -> dict[str, Any]:
    """OpenAI's error object for a stream the gateway could not finish (mid-stream upstream failure)."""
    return {"message": message, "type": "upstream_error", "param": None, "code": code}


def sse_error_event(message: str, code: str) -> bytes:
    """The event that ends such a stream on the Chat and Completions routes."""
    return b"data: " + orjson.dumps({"error": stream_error(message, code)}) + b"\n\ndata: [DONE]\n\n"


class ErrorShape:
    """How a route renders the gateway's own errors, whole or as the event that ends a stream.

    OpenAI's shape here; a route of another API family passes a subclass (``Route.errors``)."""

    #: Headers the request's id goes under besides ``x-request-id``, on answers and errors alike
    #: (Anthropic's SDK reads its own, ``request-id``).
    request_id_aliases: tuple[bytes, ...] = ()

    def headers(self, exc: GatewayError) -> list[tuple[bytes, bytes]]:
        return exc.headers()

    def body(self, exc: GatewayError) -> bytes:
        return exc.body()

    def stream_end(self, message: str, code: str) -> bytes:
        return sse_error_event(message, code)

    def refusal(self, status: int, code: str, message: str) -> bytes:
        """A request refused before any route read it (its head too large or too slow, say)."""
        return error_body(message, "invalid_request_error", code)


OPENAI_ERRORS = ErrorShape()


def openai_everywhere(path: str) -> ErrorShape:
    """The error shape at every path: OpenAI's (a server that serves no other API family)."""
    return OPENAI_ERRORS
