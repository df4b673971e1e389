"""HTTP/1.1 to the instances on asyncio protocols and httptools' parser: the proxied request's hop.

A proxy's slice of a client: send a body (held, or an upload as it arrives, with flow control) to a
known origin, read status and headers, relay the body as it arrives, reuse the connection; TLS from
asyncio. A response closed before its end aborts the connection (vLLM then frees the slot); one
read to its end goes back to the pool. A request on a kept-alive connection the server closed as
it was sent (nothing came back) is sent once more on a fresh one. What it raises (``h1.errors``)::

    H1Error
    ├── TransportError              the request did not get a whole answer
    │   ├── TimeoutException
    │   │   ├── ConnectTimeout      no connection in time
    │   │   ├── PoolTimeout         no free slot in our own pool (says nothing about the instance)
    │   │   ├── ReadTimeout         silence, or a head (or body read whole) trickled too long
    │   │   └── WriteTimeout        the instance read none of a streamed body for too long
    │   ├── NetworkError
    │   │   ├── ConnectError        nothing was sent: refused, unreachable, DNS, TLS
    │   │   └── WriteError          the connection closed while a streamed body was sent
    │   └── RemoteProtocolError     closed, or malformed, before the answer was whole
    │       └── MalformedResponse   malformed or over the limits: the instance's doing
    ├── InvalidRequest              a target or header that would split the request: not sent
    └── ResponseTooLarge            a body read whole is over the limit asked for
"""

from __future__ import annotations

from .errors import (
    ConnectError,
    ConnectTimeout,
    H1Error,
    InvalidRequest,
    MalformedResponse,
    NetworkError,
    PoolTimeout,
    ReadTimeout,
    RemoteProtocolError,
    ResponseTooLarge,
    TimeoutException,
    TransportError,
    WriteError,
    WriteTimeout,
)
from .limits import Limits
from .origin import Origin
from .pool import Pool
from .response import Response

__all__ = [
    "ConnectError",
    "ConnectTimeout",
    "H1Error",
    "InvalidRequest",
    "Limits",
    "MalformedResponse",
    "NetworkError",
    "Origin",
    "Pool",
    "PoolTimeout",
    "ReadTimeout",
    "RemoteProtocolError",
    "Response",
    "ResponseTooLarge",
    "TimeoutException",
    "TransportError",
    "WriteError",
    "WriteTimeout",
]
