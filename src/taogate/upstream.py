"""The one upstream connection pool, and what crosses the hop in each direction.

One ``aiohttp.ClientSession`` holds the proxied requests' connections to the instances; the proxy
path uses it directly through ``Upstream.send``. Probes, scrapes and admin calls use httpx's API over
a small session of their own (``httpx_aiohttp.AiohttpTransport(client=...)``), so they never queue
behind proxied requests. Measured on this machine
(benchmarks/overhead.py; see the gateway issue's note), per proxied request: httpx's default
transport ~1,900 µs of gateway CPU, httpx over the aiohttp transport ~1,650 µs, of which httpx's
client layer (cookie extraction, URL parsing, auth and redirect hooks) is ~300 µs that a proxy does
not need; calling aiohttp directly removes it.

Transport failures are translated here, once, into a ``FailureKind`` (see retry.classify)::

    aiohttp.ClientConnectorError            → connect        (refused, reset, DNS: nothing was sent)
    aiohttp.ConnectionTimeoutError          → connect_timeout
    aiohttp.ServerDisconnectedError,
    ClientPayloadError, ClientOSError       → closed         (died before a complete answer)
    aiohttp.SocketTimeoutError, TimeoutError → read_timeout  (no byte within request_timeout)
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

import aiohttp
import httpx
from httpx_aiohttp import AiohttpTransport
from multidict import CIMultiDict

from taogate.auth import CREDENTIAL_HEADERS
from taogate.errors import GatewayError, UpstreamError, UpstreamTimeout
from taogate.retry import FailureKind
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
        if self.reason.endswith("timeout"):
            return UpstreamTimeout(
                f"Instance {self.instance} did not answer in time ({self.detail}). Long prefills need a "
                "generous [gateway] request_timeout (120 s or more).",
            )
        return UpstreamError(f"Instance {self.instance} failed: {self.detail}.")


class UpstreamResponse:
    """The parts of an aiohttp response the relay uses; closing an unfinished one drops the
    connection (so vLLM sees the disconnect and aborts the request) instead of reusing it."""

    __slots__ = ("_resp", "raw_headers", "status_code")

    def __init__(self, resp: aiohttp.ClientResponse) -> None:
        self._resp = resp
        self.status_code = resp.status
        self.raw_headers: tuple[tuple[bytes, bytes], ...] = resp.raw_headers

    def header(self, name: str) -> str:
        return self._resp.headers.get(name, "")

    async def aread(self) -> bytes:
        return await self._resp.read()

    def aiter_raw(self) -> AsyncIterator[bytes]:
        return self._resp.content.iter_any()

    def close(self) -> None:
        if self._resp.content.at_eof():
            self._resp.release()
        else:
            self._resp.close()


class Upstream:
    """Owns the pooled session; ``send`` is one attempt's request."""

    def __init__(self, cfg: GatewaySettings) -> None:
        # vLLM's server (uvicorn) closes a connection idle for 5 s; reusing one it is closing right
        # then fails the request, so ours give up idle connections well before (a busy loop sees the
        # end of a response late, so "idle since" is late too).
        connector = aiohttp.TCPConnector(
            limit=cfg.max_connections, limit_per_host=0, keepalive_timeout=2.5, ttl_dns_cache=10
        )
        self.session = aiohttp.ClientSession(
            connector=connector,
            cookie_jar=aiohttp.DummyCookieJar(),  # a proxy keeps no cookies
            auto_decompress=False,  # bytes are relayed verbatim
            skip_auto_headers=("Accept-Encoding", "User-Agent"),
            trust_env=False,
        )
        self.timeout = aiohttp_timeout(cfg)
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
        self.timeout = aiohttp_timeout(cfg)
        self.client.timeout = request_timeouts(cfg)

    async def send(self, url: str, headers: list[tuple[bytes, bytes]], body: bytes) -> UpstreamResponse:
        hdrs = CIMultiDict((k.decode("latin-1"), v.decode("latin-1")) for k, v in headers)
        resp = await self.session.post(
            url, data=body, headers=hdrs, timeout=self.timeout, allow_redirects=False
        )
        return UpstreamResponse(resp)

    async def aclose(self) -> None:
        await self.client.aclose()
        await self._probe_session.close()
        await self.session.close()


def aiohttp_timeout(cfg: GatewaySettings) -> aiohttp.ClientTimeout:
    # sock_read: the longest silence from the instance (a long prefill, maybe queued, before the
    # first byte); connect: the wait for a pooled connection plus connecting.
    return aiohttp.ClientTimeout(
        total=None,
        connect=cfg.request_timeout,
        sock_connect=cfg.connect_timeout,
        sock_read=cfg.request_timeout,
    )


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
UPSTREAM_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError, OSError)


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
