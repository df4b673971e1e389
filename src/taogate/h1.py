"""HTTP/1.1 to the instances, on asyncio protocols and httptools' parser: the proxied request's hop.

Why not a client library here: measured on this machine (2 cores, one run, the thinnest pass-through
proxy under uvicorn in front of 4 instant emulators, 32 concurrent tiny requests), the proxy's CPU
per request was ~420-470 µs with aiohttp's client and ~140-160 µs with this module's approach; a
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
"""

from __future__ import annotations

import asyncio
import base64
import collections
import contextlib
import socket
import ssl
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Final, cast
from urllib.parse import unquote, urlsplit

import httptools

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

_HIGH_WATER: Final = 256 * 1024  # buffered body bytes at which reading pauses
_LOW_WATER: Final = 64 * 1024  # ... and resumes


class H1Error(Exception):
    """A failed hop; the subclass says how."""


class ConnectError(H1Error):
    """No connection: refused, unreachable, name not resolved. Nothing was sent."""


class ConnectTimeout(H1Error):
    """No connection within the connect timeout."""


class PoolTimeout(H1Error):
    """Every connection of the pool stayed in use for ``pool_timeout``: our limit, not the instance."""


class Disconnected(H1Error):
    """The connection closed, or the reply was malformed, before the answer was complete."""


class ReadTimeout(H1Error):
    """The instance sent nothing for longer than the read timeout."""


@dataclass(frozen=True, slots=True)
class Origin:
    """Where one instance lives: parsed once per base URL."""

    scheme: str
    host: str
    port: int
    path: bytes  # the base URL's path ('' or e.g. /prefix), put before each route
    authority: bytes  # the Host header
    basic_auth: bytes | None = None  # from user:password@ in the URL

    @classmethod
    def parse(cls, url: str) -> Origin:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {url!r}")
        port = parts.port or (443 if parts.scheme == "https" else 80)
        host = parts.hostname
        shown = f"[{host}]" if ":" in host else host
        default = port == (443 if parts.scheme == "https" else 80)
        authority = (shown if default else f"{shown}:{port}").encode("idna")
        auth = None
        if parts.username is not None:
            creds = f"{unquote(parts.username)}:{unquote(parts.password or '')}".encode()
            auth = b"Basic " + base64.b64encode(creds)
        return cls(parts.scheme, host, port, parts.path.rstrip("/").encode(), authority, auth)

    @property
    def key(self) -> tuple[str, str, int]:
        return (self.scheme, self.host, self.port)


class Response:
    """One response being received: status and headers first, then the body as it arrives."""

    __slots__ = (
        "_buffered",
        "_chunks",
        "_conn",
        "_error",
        "_wait_started",
        "_waiter",
        "complete",
        "headers_done",
        "keep_alive",
        "raw_headers",
        "received",
        "status_code",
    )

    def __init__(self, conn: _Conn) -> None:
        self._conn: _Conn | None = conn
        self.status_code = 0
        self.raw_headers: list[tuple[bytes, bytes]] = []
        self.headers_done = False
        self.complete = False
        self.keep_alive = False
        self.received = False  # any byte of the reply arrived
        self._chunks: collections.deque[bytes] = collections.deque()
        self._buffered = 0
        self._error: H1Error | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._wait_started = 0.0

    # -- consumer side -------------------------------------------------------------------------
    def header(self, name: str) -> str:
        """The first value of header ``name`` (case-insensitive), or ''."""
        want = name.lower().encode()
        for k, v in self.raw_headers:
            if k.lower() == want:
                return v.decode("latin-1")
        return ""

    async def aread(self) -> bytes:
        """The whole body."""
        if self.complete and self._error is None:  # all of it is here already (small answers)
            chunks = self._chunks
            data = chunks.popleft() if len(chunks) == 1 else b"".join(chunks)
            chunks.clear()
            self._buffered = 0
            self.close()
            return data
        parts = [chunk async for chunk in self.aiter_raw()]
        return parts[0] if len(parts) == 1 else b"".join(parts)

    async def aiter_raw(self) -> AsyncIterator[bytes]:
        """The body as it arrives (de-chunked), whatever is buffered joined into one piece."""
        while True:
            chunks = self._chunks
            if chunks:
                data = chunks.popleft() if len(chunks) == 1 else b"".join(chunks)
                chunks.clear()
                self._buffered = 0
                conn = self._conn
                if conn is not None and conn.paused:
                    conn.resume()
                yield data
                continue
            if self._error is not None:
                raise self._error
            if self.complete:
                self.close()  # read to the end: the connection goes back to the pool at once
                return
            await self._wait()

    def close(self) -> None:
        """Done with this response: a connection whose reply was read to its end is reused, any
        other is aborted (for an unfinished reply, that is what tells vLLM to stop)."""
        conn, self._conn = self._conn, None
        if conn is None:
            return
        if self.complete and self._error is None and self.keep_alive:
            conn.release()
        else:
            conn.abort()

    # -- producer side (the connection) ---------------------------------------------------------
    async def _wait(self) -> None:
        conn = self._conn
        assert conn is not None, "response already closed"
        loop = conn.loop
        fut = loop.create_future()
        self._waiter = fut
        self._wait_started = loop.time()
        conn.arm_timer()
        try:
            await fut
        finally:
            self._waiter = None

    def _wake(self) -> None:
        fut = self._waiter
        if fut is not None and not fut.done():
            fut.set_result(None)

    def _fail(self, error: H1Error) -> None:
        if self._error is None and not self.complete:
            self._error = error
        self._wake()


class _Conn(asyncio.Protocol):
    """One keep-alive connection to one origin; at most one request at a time."""

    def __init__(self, pool: Pool, origin: Origin) -> None:
        self.pool = pool
        self.origin = origin
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.response: Response | None = None
        self.counted = True  # holds one of the pool's connection slots
        self.closed = False
        self.paused = False
        self.idle_since = 0.0
        self.last_read = 0.0
        self._timer: asyncio.TimerHandle | None = None
        self._interim = False  # parsing a 1xx reply (100 Continue, 103 Early Hints): skipped
        self._extra = False  # a second reply to one request: ignored, the connection not reused

    # -- asyncio.Protocol ----------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's are not asyncio subclasses

    def data_received(self, data: bytes) -> None:
        r = self.response
        if r is None:  # bytes nobody asked for: this connection's framing can no longer be trusted
            self.abort()
            return
        self.last_read = self.loop.time()
        r.received = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            r._fail(Disconnected(f"malformed response from {self.origin.host}:{self.origin.port}: {exc}"))
            self.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._cancel_timer()
        self.pool._forget(self)
        r = self.response
        if r is None or r.complete:
            return
        if r.headers_done and exc is None and not _framed(r):
            r.complete = True  # a body delimited by the end of the connection
            r.keep_alive = False
            r._wake()
            return
        why = f" ({type(exc).__name__}: {exc})" if exc else ""
        r._fail(Disconnected(f"connection closed before a complete answer{why}"))

    # -- httptools callbacks -------------------------------------------------------------------
    def on_message_begin(self) -> None:
        r = self.response
        if r is not None and r.headers_done:  # a reply nobody asked for: framing can't be trusted
            self._extra = True
            r.keep_alive = False

    def on_header(self, name: bytes, value: bytes) -> None:
        if not self._extra:
            assert self.response is not None
            self.response.raw_headers.append((name, value))

    def on_headers_complete(self) -> None:
        r = self.response
        assert r is not None
        status = self.parser.get_status_code()
        if self._extra:
            return
        if 100 <= status < 200:
            self._interim = True
            r.raw_headers.clear()
            return
        r.status_code = status
        r.keep_alive = self.parser.should_keep_alive()
        r.headers_done = True
        r._wake()

    def on_body(self, body: bytes) -> None:
        r = self.response
        assert r is not None
        if self._extra:
            return
        r._chunks.append(body)
        r._buffered += len(body)
        if r._buffered > _HIGH_WATER and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()
        r._wake()

    def on_message_complete(self) -> None:
        r = self.response
        assert r is not None
        if self._interim:
            self._interim = False
            return
        if self._extra:
            return
        r.complete = True
        r.keep_alive = r.keep_alive and self.parser.should_keep_alive()
        self._cancel_timer()
        r._wake()

    # -- the connection's life -----------------------------------------------------------------
    def send(self, head: bytes, body: bytes) -> Response:
        assert self.transport is not None and self.response is None
        r = Response(self)
        self.response = r
        self.last_read = self.loop.time()
        if len(body) < 65536:  # one write; a large body is not copied to be joined
            self.transport.write(head + body)
        else:
            self.transport.write(head)
            self.transport.write(body)
        return r

    def resume(self) -> None:
        self.paused = False
        if self.transport is not None and not self.closed:
            self.transport.resume_reading()

    def arm_timer(self) -> None:
        if self._timer is None and self.pool.read_timeout is not None:
            self._timer = self.loop.call_at(self.loop.time() + self.pool.read_timeout, self._check)

    def _check(self) -> None:
        """The read timeout: silence while the consumer waits; a consumer busy elsewhere (a slow
        client downstream) is not the instance's silence."""
        self._timer = None
        r = self.response
        timeout = self.pool.read_timeout
        if r is None or r.complete or r._error is not None or timeout is None:
            return
        now = self.loop.time()
        if r._waiter is None:
            self._timer = self.loop.call_at(now + timeout, self._check)
            return
        deadline = max(self.last_read, r._wait_started) + timeout
        if now < deadline:
            self._timer = self.loop.call_at(deadline, self._check)
            return
        r._fail(ReadTimeout(f"no data from {self.origin.host}:{self.origin.port} for {timeout:g}s"))
        self.abort()

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def release(self) -> None:
        """The reply was read to its end: back to the pool."""
        self.response = None
        self._cancel_timer()
        if self.closed or self.transport is None or self.transport.is_closing():
            self.abort()
            return
        if self.paused:
            self.resume()
        self.idle_since = self.loop.time()
        self.pool._release(self)

    def abort(self) -> None:
        self._cancel_timer()
        if self.transport is not None and not self.closed:
            self.transport.abort()
        self.pool._forget(self)  # the slot frees now, not when the loop reports the loss


def _framed(r: Response) -> bool:
    """Whether the reply says where its body ends (else the end of the connection does)."""
    for k, v in r.raw_headers:
        lk = k.lower()
        if lk == b"content-length" or (lk == b"transfer-encoding" and b"chunked" in v.lower()):
            return True
    return False


@dataclass(slots=True)
class _Waiter:
    origin: Origin
    future: asyncio.Future[_Conn | None] = field(repr=False)


class Pool:
    """Keep-alive connections to any number of origins, at most ``limit`` open at once.

    Idle connections are reused newest first and dropped after ``keepalive`` seconds idle (vLLM's
    uvicorn closes them at 5 s; reusing one it is closing would fail the request). When every slot is
    taken, a request waits (FIFO, up to ``pool_timeout``) for a connection to come back or close.
    """

    def __init__(
        self,
        limit: int,
        *,
        connect_timeout: float,
        read_timeout: float | None,
        pool_timeout: float,
        keepalive: float = 2.5,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        if limit < 1:
            raise ValueError("limit must be >= 1")
        self.limit = limit
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.pool_timeout = pool_timeout
        self.keepalive = keepalive
        self._ssl = ssl_context
        self._idle: dict[tuple[str, str, int], list[_Conn]] = {}
        self._open = 0
        self._waiters: collections.deque[_Waiter] = collections.deque()
        self._all: set[_Conn] = set()
        self._closed = False

    @property
    def open_connections(self) -> int:
        return self._open

    @property
    def idle_connections(self) -> int:
        return sum(len(v) for v in self._idle.values())

    async def request(
        self, origin: Origin, path: bytes, headers: list[tuple[bytes, bytes]], body: bytes
    ) -> Response:
        """POST ``body`` to ``origin`` + ``path``; returns once the status and headers are in."""
        parts = [b"POST ", origin.path, path, b" HTTP/1.1\r\nhost: ", origin.authority, b"\r\n"]
        for k, v in headers:
            parts += (k, b": ", v, b"\r\n")
        if origin.basic_auth is not None and not any(k == b"authorization" for k, _ in headers):
            parts += (b"authorization: ", origin.basic_auth, b"\r\n")
        parts += (b"content-length: ", str(len(body)).encode(), b"\r\n\r\n")
        head = b"".join(parts)
        for attempt in (1, 2):
            # The common case, a warm idle connection, without another coroutine.
            idle = None if self._closed else self._pop_idle(origin, asyncio.get_running_loop().time())
            conn, reused = (idle, True) if idle is not None else await self._acquire(origin)
            r = conn.send(head, body)
            try:
                while not r.headers_done:
                    if r._error is not None:
                        raise r._error
                    await r._wait()
            except Disconnected:
                r.close()
                if attempt == 1 and reused and not r.received:
                    continue  # the server closed this idle connection as we sent: once more, fresh
                raise
            except BaseException:
                r.close()
                raise
            return r
        raise AssertionError("unreachable: the second attempt returns or raises")

    async def _acquire(self, origin: Origin) -> tuple[_Conn, bool]:
        if self._closed:
            raise ConnectError("the upstream pool is closed")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.pool_timeout
        while True:
            conn = self._pop_idle(origin, loop.time())
            if conn is not None:
                return conn, True
            if self._open < self.limit or self._evict_idle():
                return await self._connect(origin), False
            left = deadline - loop.time()
            if left <= 0:
                raise PoolTimeout(self._pool_timeout_message())
            waiter = _Waiter(origin, loop.create_future())
            self._waiters.append(waiter)
            try:
                async with asyncio.timeout(left):
                    handed = await waiter.future
            except BaseException as exc:
                self._abandon(waiter)
                if isinstance(exc, TimeoutError):
                    raise PoolTimeout(self._pool_timeout_message()) from None
                raise
            if handed is not None:
                return handed, True

    def _pool_timeout_message(self) -> str:
        return f"no free connection within {self.pool_timeout:g}s (all {self.limit} in use)"

    def _abandon(self, waiter: _Waiter) -> None:
        """A waiter leaves (timeout, cancelled): what was handed to it at that moment passes on."""
        with contextlib.suppress(ValueError):
            self._waiters.remove(waiter)
        fut = waiter.future
        if not fut.done():
            fut.cancel()
            return
        if fut.cancelled():  # cancelled while waiting: nothing was handed over
            return
        handed = fut.result()
        if handed is not None:
            handed.release()  # back to the pool, or to the next waiter
        else:
            self._notify_one()  # the freed slot's notice goes to the next waiter

    def _pop_idle(self, origin: Origin, now: float) -> _Conn | None:
        stack = self._idle.get(origin.key)
        while stack:
            conn = stack.pop()
            if conn.closed or conn.transport is None or conn.transport.is_closing():
                conn.abort()
                continue
            if now - conn.idle_since > self.keepalive:
                conn.abort()
                continue
            return conn
        return None

    def _evict_idle(self) -> bool:
        """At the limit: close the longest-idle connection to any origin to free its slot."""
        oldest: _Conn | None = None
        for stack in self._idle.values():
            if stack and (oldest is None or stack[0].idle_since < oldest.idle_since):
                oldest = stack[0]
        if oldest is None:
            return False
        self._idle[oldest.origin.key].remove(oldest)
        oldest.abort()
        return True

    async def _connect(self, origin: Origin) -> _Conn:
        self._open += 1
        loop = asyncio.get_running_loop()
        tls = origin.scheme == "https"
        if tls and self._ssl is None:
            self._ssl = ssl.create_default_context()
        try:
            async with asyncio.timeout(self.connect_timeout):
                _, conn = await loop.create_connection(
                    lambda: _Conn(self, origin),
                    origin.host,
                    origin.port,
                    ssl=self._ssl if tls else None,
                    server_hostname=origin.host if tls else None,
                )
        except TimeoutError:
            self._slot_freed()
            raise ConnectTimeout(
                f"no connection to {origin.host}:{origin.port} within {self.connect_timeout:g}s"
            ) from None
        except (OSError, ssl.SSLError) as exc:
            self._slot_freed()
            raise ConnectError(f"cannot connect to {origin.host}:{origin.port}: {exc}") from exc
        except BaseException:
            self._slot_freed()
            raise
        sock = conn.transport.get_extra_info("socket") if conn.transport is not None else None
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self._closed:
            conn.abort()
            raise ConnectError("the upstream pool is closed")
        self._all.add(conn)
        return conn

    # -- called by connections -----------------------------------------------------------------
    def _release(self, conn: _Conn) -> None:
        if self._closed:
            conn.abort()
            return
        for waiter in self._waiters:  # a request waiting for this origin takes it as it is
            if waiter.origin.key == conn.origin.key and not waiter.future.done():
                self._waiters.remove(waiter)
                waiter.future.set_result(conn)
                return
        if any(not w.future.done() for w in self._waiters):
            conn.abort()  # someone waits for another origin: free the slot for them
            return
        self._idle.setdefault(conn.origin.key, []).append(conn)

    def _forget(self, conn: _Conn) -> None:
        if not conn.counted:
            return
        conn.counted = False
        self._all.discard(conn)
        stack = self._idle.get(conn.origin.key)
        if stack and conn in stack:
            stack.remove(conn)
        self._slot_freed()

    def _slot_freed(self) -> None:
        self._open -= 1
        self._notify_one()

    def _notify_one(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.future.done():
                waiter.future.set_result(None)
                return

    async def aclose(self) -> None:
        """Close every connection; requests in flight fail with ``Disconnected``."""
        self._closed = True
        for conn in list(self._all):
            conn.abort()
        for waiter in self._waiters:
            if not waiter.future.done():
                waiter.future.set_result(None)
        self._idle.clear()
        await asyncio.sleep(0)  # let the transports report their loss
