"""HTTP/1.1 to the instances, on asyncio protocols and httptools' parser: the proxied request's hop.

A proxy needs a small slice of an HTTP client: POST a body it already holds to a known origin, read
a status and headers, relay the body as it arrives, reuse the connection. No redirects, cookies,
decompression, proxies or multipart; TLS comes from asyncio. It runs on every proxied request, and
this slice costs a fraction of a general client's CPU (``benchmarks/overhead.py`` measures it
against the same proxy on aiohttp and on httpx). Everything else uses httpx.

Per connection, one protocol object parses responses with httptools; a ``Response`` hands the body
to the relay chunk by chunk with flow control (reading pauses while a slow client lags behind). A
response closed before its end aborts the connection, so vLLM sees the disconnect and frees the
slot; one read to its end goes back to the pool.

Failures are httpx's own exception classes, so the proxied hop and the control plane speak one
vocabulary (``proxy.upstream.translate`` maps them onto retry decisions)::

    httpx.ConnectError         nothing was sent: refused, unreachable, DNS
    httpx.ConnectTimeout       no connection in time
    httpx.PoolTimeout          no free slot in our own pool in time (says nothing about the instance)
    httpx.RemoteProtocolError  the connection closed, or the reply was malformed, before the answer was whole
      MalformedResponse        of those, a reply malformed or over the limits (the instance's doing)
    httpx.ReadTimeout          the instance was silent for longer than the read timeout, or
                               trickled its head for longer than that in all
    ResponseTooLarge           a body read whole is over the limit asked for (not a transport error)

A request on a reused keep-alive connection that the server closed at that moment (nothing of a
reply came back) is sent again once on a fresh connection, as HTTP clients do for idle races.
"""

from __future__ import annotations

from .connection import MalformedResponse, Response, ResponseTooLarge
from .origin import Origin
from .pool import Pool

__all__ = ["MalformedResponse", "Origin", "Pool", "Response", "ResponseTooLarge"]
