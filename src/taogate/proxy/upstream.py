"""The upstream connection pools, and what crosses the hop in each direction.

Proxied requests go over ``h1.Pool`` (HTTP/1.1 on asyncio protocols; its docstring has the
measurement that put it there instead of a client library). Probes, scrapes and admin calls use
httpx's API over a small aiohttp session of their own (``httpx_aiohttp.AiohttpTransport``), so they
never queue behind proxied requests for a connection.

Transport failures are translated here, once, into a ``FailureKind`` (see retry.classify)::

    h1.ConnectError, aiohttp.ClientConnectorError      → connect        (nothing was sent)
    h1.ConnectTimeout, aiohttp.ConnectionTimeoutError  → connect_timeout
    h1.Disconnected, aiohttp.ServerDisconnectedError,
      ClientPayloadError, ClientOSError                → closed         (died before a complete answer)
    h1.ReadTimeout, aiohttp.SocketTimeoutError,
      TimeoutError                                     → read_timeout   (no byte within request_timeout)
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any

import aiohttp
import httpx
from httpx_aiohttp import AiohttpTransport

from taogate import h1
from taogate.errors import GatewayError, NoInstance, UpstreamError, UpstreamTimeout
from taogate.proxy.auth import CREDENTIAL_HEADERS
from taogate.proxy.retry import FailureKind
from taogate.settings import GatewaySettings

#: Hop-by-hop headers (RFC 9110 §7.6.1) and those the relay recomputes; never forwarded either way.
HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-connection",
        b"transfer-encoding",
        b"te",
        b"trailer",
        b"upgrade",
        b"host",
        b"content-length",
        b"expect",
    }
)
_DROP_UP = HOP_BY_HOP | CREDENTIAL_HEADERS | {b"x-request-tag", b"x-request-id", b"accept-encoding"}
_DROP_DOWN = HOP_BY_HOP | {b"server", b"date", b"x-request-id"}


@dataclass
class AttemptFailure(Exception):
    """An attempt failed before any byte went downstream and a retry elsewhere was granted."""

    reason: str  # bounded (retry.classify): connect, closed, read_timeout, status_503, ...
    instance: str
    detail: str

    def as_error(self) -> GatewayError:
        if self.reason == FailureKind.POOL_TIMEOUT:
            return NoInstance(
                f"The gateway's upstream connection pool is exhausted ({self.detail}); raise "
                "[gateway] max_connections to at least the sum of the instances' max_queue.",
                retry_after=1,
            )
        if self.reason.endswith("timeout"):
            return UpstreamTimeout(
                f"Instance {self.instance} did not answer in time ({self.detail}). Long prefills need a "
                "generous [gateway] request_timeout (120 s or more).",
            )
        return UpstreamError(f"Instance {self.instance} failed: {self.detail}.")


#: What the relay reads: status, headers, then the body as it arrives (see h1.Response).
UpstreamResponse = h1.Response


class Upstream:
    """Owns the pools; ``send`` is one attempt's request."""

    def __init__(self, cfg: GatewaySettings) -> None:
        # vLLM's server (uvicorn) closes a connection idle for 5 s; reusing one it is closing right
        # then fails the request, so ours give up idle connections well before (a busy loop sees the
        # end of a response late, so "idle since" is late too).
        self.pool = h1.Pool(
            cfg.max_connections,
            connect_timeout=cfg.connect_timeout,
            read_timeout=cfg.request_timeout,
            pool_timeout=cfg.request_timeout,
            keepalive=2.5,
        )
        self._origins: dict[str, h1.Origin] = {}
        # httpx's API for probes, scrapes and admin calls, over a small pool of their own: a probe
        # must never wait behind proxied requests for a connection (a saturated pool would make
        # healthy instances fail their probes).
        self._probe_session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=32, keepalive_timeout=2.5),
            cookie_jar=aiohttp.DummyCookieJar(),
            trust_env=False,
        )
        self.client = httpx.AsyncClient(
            transport=AiohttpTransport(client=self._probe_session),
            timeout=request_timeouts(cfg),
            trust_env=False,
        )

    def configure(self, cfg: GatewaySettings) -> None:
        """Timeouts follow a reload; the pool size is fixed for the process's life."""
        self.pool.connect_timeout = cfg.connect_timeout
        self.pool.read_timeout = cfg.request_timeout
        self.pool.pool_timeout = cfg.request_timeout
        self.client.timeout = request_timeouts(cfg)

    def send(
        self, base_url: str, path: bytes, headers: list[tuple[bytes, bytes]], body: bytes
    ) -> Coroutine[Any, Any, UpstreamResponse]:
        """POST ``body`` to the instance at ``base_url``; awaiting it returns once status and headers
        are in. The pool's coroutine itself, not one more around it: this is once per request."""
        origin = self._origins.get(base_url)
        if origin is None:
            origin = self._origins[base_url] = h1.Origin.parse(base_url)
        return self.pool.request(origin, path, headers, body)

    async def aclose(self) -> None:
        await self.client.aclose()
        await self._probe_session.close()
        await self.pool.aclose()


def request_timeouts(cfg: GatewaySettings) -> httpx.Timeout:
    return httpx.Timeout(
        connect=cfg.connect_timeout,
        read=cfg.request_timeout,
        write=cfg.write_timeout,
        pool=cfg.request_timeout,
    )


def translate(exc: BaseException) -> tuple[FailureKind, str]:
    """An aiohttp (or httpx-over-aiohttp) exception → how the attempt failed, and a short description."""
    cause = exc.__cause__ if isinstance(exc, httpx.HTTPError) and exc.__cause__ is not None else exc
    name = type(cause).__name__
    if isinstance(cause, h1.ConnectError):
        return FailureKind.CONNECT, str(cause)
    if isinstance(cause, h1.ConnectTimeout):
        return FailureKind.CONNECT_TIMEOUT, str(cause)
    if isinstance(cause, h1.PoolTimeout):
        return FailureKind.POOL_TIMEOUT, str(cause)
    if isinstance(cause, h1.Disconnected):
        return FailureKind.CLOSED, str(cause)
    if isinstance(cause, h1.ReadTimeout):
        return FailureKind.READ_TIMEOUT, str(cause)
    if isinstance(cause, aiohttp.ClientConnectorError):
        return FailureKind.CONNECT, f"cannot connect ({cause})"
    if isinstance(cause, aiohttp.ConnectionTimeoutError):
        return FailureKind.CONNECT_TIMEOUT, "no connection within the connect timeout"
    if isinstance(
        cause, aiohttp.ServerDisconnectedError | aiohttp.ClientPayloadError | aiohttp.ClientOSError
    ):
        return FailureKind.CLOSED, f"connection closed before a complete answer ({name}: {cause})"
    if isinstance(cause, asyncio.TimeoutError | aiohttp.ServerTimeoutError):
        return FailureKind.READ_TIMEOUT, f"no answer within the read timeout ({name})"
    return FailureKind.CLOSED, f"connection failed ({name})"


#: What ``Upstream.send`` and a relay may raise for a failed hop (translated by ``translate``).
UPSTREAM_ERRORS = (h1.H1Error, aiohttp.ClientError, asyncio.TimeoutError, OSError)


def upstream_headers(
    client_headers: list[tuple[bytes, bytes]],
    *,
    request_id: bytes,
    tag: bytes | None,
) -> list[tuple[bytes, bytes]]:
    """Client headers minus hop-by-hop and credentials, plus the request id and tag.

    The instance's own key (if any) is added per attempt, since a retry may go elsewhere.
    """
    out = [(k, v) for k, v in client_headers if k not in _DROP_UP]
    out.append((b"x-request-id", request_id))
    if tag:
        out.append((b"x-request-tag", tag))
    return out


def downstream_headers(
    raw: tuple[tuple[bytes, bytes], ...] | list[tuple[bytes, bytes]], *, request_id: bytes, instance: str
) -> list[tuple[bytes, bytes]]:
    """The instance's response headers minus hop-by-hop and framing (the relay recomputes length),
    plus the request id and which instance served it."""
    out = [(lk, v) for k, v in raw if (lk := k.lower()) not in _DROP_DOWN]
    out.append((b"x-request-id", request_id))
    out.append((b"x-taogate-instance", instance.encode()))
    return out
