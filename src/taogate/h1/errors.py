"""What ``h1`` raises: its own small tree (drawn in the package docstring), nothing borrowed.

Each failure is raised as a new instance where it is met; a response keeps only what to raise
(class and message), never a raised exception, whose traceback would hold the response and its
buffers in a reference cycle.
"""

from __future__ import annotations

__all__ = [
    "ConnectError",
    "ConnectTimeout",
    "H1Error",
    "InvalidRequest",
    "MalformedResponse",
    "NetworkError",
    "PoolTimeout",
    "ReadTimeout",
    "RemoteProtocolError",
    "ResponseTooLarge",
    "TimeoutException",
    "TransportError",
    "WriteError",
    "WriteTimeout",
]


class H1Error(Exception):
    """Anything ``h1`` raises."""


class TransportError(H1Error):
    """The hop failed: the request did not get a whole answer."""


class TimeoutException(TransportError):
    """Something took longer than its timeout."""


class ConnectTimeout(TimeoutException):
    """No connection in time."""


class PoolTimeout(TimeoutException):
    """No free slot in our own pool in time (says nothing about the instance)."""


class ReadTimeout(TimeoutException):
    """The instance was silent for the read timeout, or trickled its head (or a body read whole)
    for longer than that in all."""


class WriteTimeout(TimeoutException):
    """The instance read none of a streamed request body for the read timeout."""


class NetworkError(TransportError):
    """The connection failed."""


class ConnectError(NetworkError):
    """Nothing was sent: refused, unreachable, DNS, TLS."""


class WriteError(NetworkError):
    """The connection closed while a streamed request body was being sent."""


class RemoteProtocolError(TransportError):
    """The connection closed, or the reply was malformed, before the answer was whole."""


class MalformedResponse(RemoteProtocolError):
    """The instance answered, but not in HTTP/1.1 this client takes: malformed, an upgrade, or a
    head over the pool's limits (the connection itself was fine: this is the instance's doing)."""


class InvalidRequest(H1Error):
    """A request this client refuses to send: a target or header that would split the request
    (CR, LF, NUL or another control byte; a space in the target). Nothing was sent."""


class ResponseTooLarge(H1Error):
    """A body read whole (``Response.aread``) is larger than the limit asked for."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"the answer's body exceeds {limit} bytes")
        self.limit = limit
