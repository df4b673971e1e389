"""The one pooled upstream HTTP client, and what crosses the hop in each direction.

httpx's API over aiohttp's transport: measured on this machine (see benchmarks/overhead.py and the
gateway issue), httpx's default transport costs ~4x the CPU per proxied request of the aiohttp one.

Transport failures are translated here, once, into ``AttemptFailure`` (retryable on another
instance, before any byte went downstream) or the gateway's own OpenAI-shaped errors.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import aiohttp
import httpx
from httpx_aiohttp import AiohttpTransport

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
_DROP_DOWN = frozenset({*HOP_BY_HOP - {b"content-length"}, b"server", b"date", b"x-request-id"})


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


def make_client(cfg: GatewaySettings) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=cfg.max_connections, max_keepalive_connections=cfg.max_connections)
    transport = AiohttpTransport(limits=limits, trust_env=False)
    return httpx.AsyncClient(transport=transport, timeout=request_timeouts(cfg), trust_env=False)


def request_timeouts(cfg: GatewaySettings) -> httpx.Timeout:
    # read: the wait for the response (a long prefill, maybe queued); pool: the wait for a free
    # connection, which max_connections can make as long as a read.
    return httpx.Timeout(
        connect=cfg.connect_timeout,
        read=cfg.request_timeout,
        write=cfg.write_timeout,
        pool=cfg.request_timeout,
    )


def translate(exc: Exception) -> tuple[FailureKind, str]:
    """An httpx exception → how the attempt failed, and a short description.

    The aiohttp transport files every ``ClientConnectionError`` (a server that closed the connection
    included) under ``httpx.ConnectTimeout``, so the aiohttp cause decides where it is known.
    """
    cause = exc.__cause__
    name = type(cause or exc).__name__
    if isinstance(cause, aiohttp.ServerDisconnectedError | aiohttp.ClientPayloadError):
        return FailureKind.CLOSED, f"connection closed before an answer ({name})"
    if isinstance(cause, aiohttp.ClientConnectorError) or isinstance(exc, httpx.ConnectError):
        return FailureKind.CONNECT, f"cannot connect ({cause or exc})"
    if isinstance(exc, httpx.PoolTimeout):
        return FailureKind.POOL_TIMEOUT, "no free upstream connection ([gateway] max_connections)"
    if isinstance(exc, httpx.WriteTimeout):
        return FailureKind.WRITE_TIMEOUT, "request body not accepted in time"
    if isinstance(exc, httpx.TimeoutException) or isinstance(cause, asyncio.TimeoutError):
        return FailureKind.READ_TIMEOUT, f"no answer within the read timeout ({name})"
    return FailureKind.CLOSED, f"connection failed ({name})"


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


def downstream_headers(raw: list[tuple[bytes, bytes]], *, keep_length: bool) -> list[tuple[bytes, bytes]]:
    out = []
    for k, v in raw:
        lk = k.lower()
        if lk in _DROP_DOWN or (lk == b"content-length" and not keep_length):
            continue
        out.append((lk, v))
    return out
