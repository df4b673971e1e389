"""HTTP/1.1 to the instances, on asyncio protocols and httptools' parser: the proxied request's hop.

A proxy needs a small slice of an HTTP client: POST a body to a known origin (one it holds, or an
upload sent as it arrives, with flow control), read a status and headers, relay the body as it
arrives, reuse the connection. No redirects, cookies, decompression, proxies or multipart; TLS
comes from asyncio. This slice costs a fraction of a general client's CPU (``benchmarks/overhead.py``).

Per connection, one protocol object parses responses with httptools; a ``Response`` hands the body
to the relay chunk by chunk with flow control. A response closed before its end aborts the
connection, so vLLM sees the disconnect and frees the slot; one read to its end goes back to the
pool. A request on a reused keep-alive connection that the server closed at that moment (nothing
of a reply came back) is sent again once on a fresh connection. What it raises (``h1.errors``)::

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
