"""The proxied hop: the connection pool to the instances, and what crosses it in each direction.

Proxied requests go over ``h1.Pool``. Its failures (httpx's exception classes) are translated here,
once, into a ``FailureKind`` (see ``retry.classify``)::

    httpx.ConnectError         → connect          (nothing was sent)
    httpx.ConnectTimeout       → connect_timeout
    httpx.PoolTimeout          → pool_timeout     (our own pool; not the instance's fault)
    httpx.RemoteProtocolError,
      OSError, anything else   → closed           (died before a complete answer, or sent one
                                                   that is malformed or over the head limits)
    httpx.ReadTimeout          → read_timeout     (no byte, or no complete head or whole
                                                   body, within request_timeout)

``h1.ResponseTooLarge`` is none of these: the pipeline answers it itself.
"""

from __future__ import annotations

from collections.abc import Coroutine, Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from taogate import h1
from taogate.errors import GatewayError, NoInstance, UpstreamError, UpstreamTimeout
from taogate.proxy.auth import CREDENTIAL_HEADERS
from taogate.proxy.multipart import StreamedBody
from taogate.proxy.priority import HEADER, VLLM_HEADER
from taogate.proxy.retry import FailureKind
from taogate.proxy.streamed import StreamedResponse, StreamedUploads
from taogate.settings import GatewaySettings

_FORWARDED_FOR = b"x-forwarded-for"
#: Hop-by-hop headers (RFC 9110 §7.6.1) and those the relay recomputes; never forwarded either way.
#: Headers a ``Connection`` field names are hop-by-hop too, and dropped with it.
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
_DROP_UP = (
    HOP_BY_HOP
    | CREDENTIAL_HEADERS
    | {
        b"x-request-tag",
        b"x-request-id",
        b"accept-encoding",
        HEADER,  # the gateway's own (proxy.priority)
        VLLM_HEADER,  # the gateway decides what an instance is told
        _FORWARDED_FOR,  # written anew, the client's address appended (``upstream_headers``)
    }
)
#: From an instance's answer, besides the hop-by-hop ones: what the gateway says itself (date,
#: server and what it runs on, request id), and what would speak for the gateway's origin to
#: every client, which no instance behind one key may: cookies, HSTS, alternative services, proxy
#: authentication.
_DROP_DOWN = HOP_BY_HOP | {
    b"server",
    b"x-powered-by",
    b"date",
    b"x-request-id",
    b"set-cookie",
    b"set-cookie2",
    b"strict-transport-security",
    b"alt-svc",
    b"proxy-authenticate",
    b"proxy-authentication-info",
}
_DROP_DOWN_LOAD = _DROP_DOWN | {b"endpoint-load-metrics"}
#: Only the gateway speaks in its own namespace, in both directions.
_OURS = b"x-taogate-"


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
UpstreamResponse = h1.Response | StreamedResponse


class Upstream:
    """Owns the pool to the instances; ``send`` is one attempt's request."""

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
            max_header_bytes=cfg.max_response_header_bytes,
            max_headers=cfg.max_response_headers,
        )
        self._origins: dict[str, h1.Origin] = {}
        self.uploads = StreamedUploads(cfg)

    def configure(self, cfg: GatewaySettings) -> None:
        """Timeouts follow a reload; the pool size is fixed for the process's life."""
        self.pool.connect_timeout = cfg.connect_timeout
        self.pool.read_timeout = cfg.request_timeout
        self.pool.pool_timeout = cfg.request_timeout
        self.pool.max_header_bytes = cfg.max_response_header_bytes
        self.pool.max_headers = cfg.max_response_headers
        self.uploads.configure(cfg)

    def send(
        self,
        base_url: str,
        path: bytes,
        headers: list[tuple[bytes, bytes]],
        body: bytes | StreamedBody,
        method: bytes = b"POST",
    ) -> Coroutine[Any, Any, UpstreamResponse]:
        """Send ``body`` to the instance at ``base_url``; awaiting it returns once status and headers
        are in. The pool's coroutine itself, not one more around it: this is once per request."""
        if isinstance(body, StreamedBody):
            return self.uploads.send(base_url, path, headers, body)
        origin = self._origins.get(base_url)
        if origin is None:
            origin = self._origins[base_url] = h1.Origin.parse(base_url)
        return self.pool.request(origin, path, headers, body, method)

    async def aclose(self) -> None:
        await self.pool.aclose()
        await self.uploads.aclose()


def translate(exc: BaseException) -> tuple[FailureKind, str]:
    """A failed hop → how the attempt failed, and a short description."""
    if isinstance(exc, httpx.ConnectError):
        return FailureKind.CONNECT, str(exc)
    if isinstance(exc, httpx.ConnectTimeout):
        return FailureKind.CONNECT_TIMEOUT, str(exc)
    if isinstance(exc, httpx.PoolTimeout):
        return FailureKind.POOL_TIMEOUT, str(exc)
    if isinstance(exc, httpx.ReadTimeout):
        return FailureKind.READ_TIMEOUT, str(exc)
    if isinstance(exc, httpx.RemoteProtocolError):
        return FailureKind.CLOSED, str(exc)
    return FailureKind.CLOSED, f"connection failed ({type(exc).__name__}: {exc})"


#: What ``Upstream.send`` and a relay may raise for a failed hop (translated by ``translate``).
UPSTREAM_ERRORS = (httpx.TransportError, OSError)


def _nominated(headers: Sequence[tuple[bytes, bytes]], lower: bool) -> frozenset[bytes]:
    """The header names the ``Connection`` fields list (empty for the usual ``keep-alive``/``close``,
    which are dropped anyway)."""
    names: set[bytes] = set()
    for k, v in headers:
        if (k.lower() if lower else k) == b"connection":
            names.update(t for token in v.split(b",") if (t := token.strip().lower()))
    return frozenset(names - HOP_BY_HOP - {b"close"})


def upstream_headers(
    client_headers: list[tuple[bytes, bytes]],
    *,
    request_id: bytes,
    tag: bytes | None,
    client: tuple[str, int] | None = None,
) -> list[tuple[bytes, bytes]]:
    """Client headers minus hop-by-hop (and those its Connection field names), credentials and the
    gateway's own, plus the request id and tag, and ``X-Forwarded-For`` as a proxy writes it: the
    client's own list (if any) with the client's address appended, so its last entry is the one
    the gateway saw (the earlier ones are only what the client claims).

    The instance's own key (if any) is added per attempt, since a retry may go elsewhere.
    """
    drop = _DROP_UP
    nominated = _nominated(client_headers, lower=False)  # ASGI names are lower-case already
    if nominated:
        drop = drop | nominated
    out = [(k, v) for k, v in client_headers if k not in drop and not k.startswith(_OURS)]
    if client is not None:
        hops = [v for k, v in client_headers if k == _FORWARDED_FOR]
        out.append((_FORWARDED_FOR, b", ".join([*hops, client[0].encode()])))
    out.append((b"x-request-id", request_id))
    if tag:
        out.append((b"x-request-tag", tag))
    return out


def downstream_headers(
    raw: Sequence[tuple[bytes, bytes]], *, request_id: bytes, instance: str, drop_load: bool = False
) -> list[tuple[bytes, bytes]]:
    """The instance's response headers minus hop-by-hop and framing (the relay recomputes length),
    those only the gateway may set, plus the request id and which instance served it. ``drop_load``:
    the gateway asked for the engine's load report, not the client, who does not see it."""
    drop = _DROP_DOWN_LOAD if drop_load else _DROP_DOWN
    nominated = _nominated(raw, lower=True)
    if nominated:
        drop = drop | nominated
    out = [(lk, v) for k, v in raw if (lk := k.lower()) not in drop and not lk.startswith(_OURS)]
    out.append((b"x-request-id", request_id))
    out.append((b"x-taogate-instance", instance.encode()))
    return out
