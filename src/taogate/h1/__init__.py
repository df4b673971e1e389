"""HTTP/1.1 to the instances, on asyncio protocols and httptools' parser: the proxied request's hop.

Why not a client library here: measured on this machine (2 cores, one run, the thinnest pass-through
proxy under uvicorn in front of 4 instant emulators, 32 concurrent tiny requests), the proxy's CPU
per request was ~420-470 µs with aiohttp's client and ~140-160 µs with this package's approach; a
gateway spends that on every request. A proxy needs a small slice of a client: POST a body it already
holds to a known origin, read a status and headers, relay the body as it arrives, reuse the
connection. No redirects, cookies, decompression, proxies or multipart; TLS comes from asyncio.
httpx's API stays in use for everything that is not the proxied request (probes, scrapes, admin).

Per connection, one protocol object parses responses with httptools; a ``Response`` hands the body
to the relay chunk by chunk with flow control (reading pauses while ``_HIGH_WATER`` bytes wait for
a slow client). A response closed before its end aborts the connection, so vLLM sees the disconnect
and frees the slot; one read to its end goes back to the pool. Failures are typed (the gateway's
``upstream.translate`` maps them to retry decisions)::

    ConnectError      nothing was sent: refused, unreachable, DNS
    ConnectTimeout    no connection in time
    PoolTimeout       no free slot in our own pool in time (says nothing about the instance)
    Disconnected      the connection closed, or the reply was malformed, before the answer was whole
    ReadTimeout       the instance was silent for longer than the read timeout

A request on a reused keep-alive connection that the server closed at that moment (nothing of a
reply came back) is sent again once on a fresh connection, as HTTP clients do for idle races.

The package: ``errors`` (the failures above), ``origin`` (a base URL parsed once), ``connection``
(one keep-alive connection's protocol and the ``Response`` it feeds), ``pool`` (connections per
origin, the global limit, waiters).
"""

from __future__ import annotations

from .connection import Response
from .errors import ConnectError, ConnectTimeout, Disconnected, H1Error, PoolTimeout, ReadTimeout
from .origin import Origin
from .pool import Pool

__all__ = [
    "ConnectError",
    "ConnectTimeout",
    "Disconnected",
    "H1Error",
    "Origin",
    "Pool",
    "PoolTimeout",
    "ReadTimeout",
    "Response",
]
