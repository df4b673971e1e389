"""The proxied hop: the connection pool to the instances, and what crosses it in each direction.

Proxied requests, uploads too, go over ``h1.Pool``. Its failures are mapped here, once, onto a
``retry.Failure`` (``failure_of``), which ``retry.judge`` turns into what the pipeline does::

    h1.ConnectError              → connect          (nothing was sent)
    h1.ConnectTimeout            → connect_timeout
    h1.PoolTimeout               → pool_timeout     (our own pool; not the instance's fault)
    h1.ReadTimeout, WriteTimeout → read_timeout     (silent, or no whole answer in time)
    h1.RemoteProtocolError,
      WriteError, anything else  → closed           (died before a complete answer; a malformed
                                                     one, or over the limits, is marked so)

``h1.ResponseTooLarge`` and ``h1.InvalidRequest`` are none of these: the pipeline answers them.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, Coroutine, Sequence
from typing import Any

from taogate import h1
from taogate.gateway_settings import GatewaySettings
from taogate.proxy.auth import CREDENTIAL_HEADERS
from taogate.proxy.priority import HEADER, VLLM_HEADER
from taogate.proxy.retry import Failure, FailureKind

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
    b"request-id",
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


#: What the relay reads: status, headers, then the body as it arrives.
UpstreamResponse = h1.Response


def hop_limits(cfg: GatewaySettings) -> h1.Limits:
    """What a config tells the pool: its timeouts and the bounds on an instance's reply head."""
    return h1.Limits(
        connect_timeout=cfg.connect_timeout,
        read_timeout=cfg.request_timeout,
        pool_timeout=cfg.request_timeout,
        max_header_bytes=cfg.max_response_header_bytes,
        max_headers=cfg.max_response_headers,
    )


class Upstream:
    """Owns the pool to the instances (its size fixed for the process's life); ``send`` is one
    attempt's request."""

    def __init__(self, cfg: GatewaySettings) -> None:
        limits = hop_limits(cfg)
        # vLLM's server (uvicorn) closes a connection idle for 5 s; reusing one it is closing right
        # then fails the request, so ours give up idle connections well before (a busy loop sees the
        # end of a response late, so "idle since" is late too).
        self.pool = h1.Pool(
            cfg.max_connections,
            connect_timeout=limits.connect_timeout,
            read_timeout=limits.read_timeout,
            pool_timeout=limits.pool_timeout,
            keepalive=2.5,
            max_header_bytes=limits.max_header_bytes,
            max_headers=limits.max_headers,
        )
        self._origins: dict[str, h1.Origin] = {}

    @property
    def limits(self) -> h1.Limits:
        return self.pool.limits

    @limits.setter
    def limits(self, limits: h1.Limits) -> None:
        """A reloaded config's, for the requests from now on (the open connections stay)."""
        self.pool.limits = limits

    def send(
        self,
        base_url: str,
        path: bytes,
        headers: list[tuple[bytes, bytes]],
        body: bytes | AsyncIterable[bytes],
        method: bytes = b"POST",
    ) -> Coroutine[Any, Any, UpstreamResponse]:
        """Send ``body`` (held, or sent as it arrives) to the instance at ``base_url``; awaiting it
        returns once status and headers are in. The pool's coroutine itself, not one more around it:
        this is once per request."""
        origin = self._origins.get(base_url)
        if origin is None:
            origin = self._origins[base_url] = h1.Origin.parse(base_url)
        return self.pool.request(origin, path, headers, body, method)

    async def aclose(self) -> None:
        await self.pool.aclose()


_KINDS: tuple[tuple[type[h1.TransportError], FailureKind], ...] = (
    (h1.ConnectError, FailureKind.CONNECT),
    (h1.ConnectTimeout, FailureKind.CONNECT_TIMEOUT),
    (h1.PoolTimeout, FailureKind.POOL_TIMEOUT),
    (h1.ReadTimeout, FailureKind.READ_TIMEOUT),
    (h1.WriteTimeout, FailureKind.READ_TIMEOUT),
    (h1.RemoteProtocolError, FailureKind.CLOSED),
    (h1.WriteError, FailureKind.CLOSED),
)


def failure_of(exc: h1.TransportError) -> Failure:
    """A failed hop → the attempt's failure (``retry.judge`` says what follows)."""
    malformed = isinstance(exc, h1.MalformedResponse)
    for cls, kind in _KINDS:
        if isinstance(exc, cls):
            return Failure(kind, str(exc), malformed=malformed)
    return Failure(FailureKind.CLOSED, f"connection failed ({type(exc).__name__}: {exc})")


def status_failure(status: int) -> Failure:
    """An instance's answer with an error status, as a failed attempt."""
    return Failure(FailureKind.STATUS, f"HTTP {status}", status=status)


#: What ``Upstream.send`` and a relay raise for a failed hop (mapped by ``failure_of``).
UPSTREAM_ERRORS = h1.TransportError


def _nominated(headers: Sequence[tuple[bytes, bytes]]) -> frozenset[bytes]:
    """The header names (lower case) the ``Connection`` fields list (empty for the usual
    ``keep-alive``/``close``, which are dropped anyway)."""
    names: set[bytes] | None = None  # the usual headers have no Connection field: nothing built
    for k, v in headers:
        if k == b"connection":
            names = names if names is not None else set()
            names.update(t for token in v.split(b",") if (t := token.strip().lower()))
    return _NOMINATED_NONE if names is None else frozenset(names - HOP_BY_HOP - {b"close"})


_NOMINATED_NONE: frozenset[bytes] = frozenset()


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

    One pass keeps the client's own pairs; a Connection field (rare from clients) costs a second.
    The instance's own key (if any) is added per attempt, since a retry may go elsewhere.
    """
    out = []
    hops: list[bytes] = []
    connection = False
    for pair in client_headers:  # ASGI names are lower-case already
        k = pair[0]
        if k in _DROP_UP or k.startswith(_OURS):
            if k == _FORWARDED_FOR:
                hops.append(pair[1])
            elif k == b"connection":
                connection = True
        else:
            out.append(pair)
    if connection:
        out = _without_nominated(out, client_headers)
    if client is not None:
        hops.append(client[0].encode())
    if hops:  # without ``client`` (picker mode: the gateway in front wrote it), the list as it came
        out.append((_FORWARDED_FOR, b", ".join(hops)))
    out.append((b"x-request-id", request_id))
    if tag:
        out.append((b"x-request-tag", tag))
    return out


def _without_nominated(
    kept: list[tuple[bytes, bytes]], headers: Sequence[tuple[bytes, bytes]]
) -> list[tuple[bytes, bytes]]:
    """``kept`` less the headers the ``Connection`` fields of ``headers`` name."""
    nominated = _nominated(headers)
    return [pair for pair in kept if pair[0] not in nominated] if nominated else kept


def downstream_headers(
    raw: Sequence[tuple[bytes, bytes]], *, request_id: bytes, instance: str, drop_load: bool = False
) -> list[tuple[bytes, bytes]]:
    """The instance's response headers (names in lower case, as ``h1`` gives them) minus hop-by-hop
    and framing (the relay recomputes length), those only the gateway may set, plus the request id
    and which instance served it. ``drop_load``: the gateway asked for the engine's load report,
    not the client, who does not see it."""
    drop = _DROP_DOWN_LOAD if drop_load else _DROP_DOWN
    out = []
    connection = False
    for pair in raw:
        k = pair[0]
        if k in drop or k.startswith(_OURS):
            connection = connection or k == b"connection"
        else:
            out.append(pair)
    if connection:
        out = _without_nominated(out, raw)
    out.append((b"x-request-id", request_id))
    out.append((b"x-taogate-instance", instance.encode()))
    return out
