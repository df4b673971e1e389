"""Keep-alive connections to any number of origins, at most ``limit`` open at once (if any), and
the requests waiting for one."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import socket
import ssl
from collections.abc import AsyncIterable
from dataclasses import dataclass, field
from typing import cast

from .connection import Connection
from .errors import ConnectError, ConnectTimeout, InvalidRequest, PoolTimeout, RemoteProtocolError
from .limits import Limits
from .origin import Origin
from .response import Response

__all__ = ["Pool"]


@dataclass(slots=True)
class _Waiter:
    origin: Origin
    future: asyncio.Future[Connection | None] = field(repr=False)


class Pool:
    """Keep-alive connections to any number of origins, at most ``limit`` open at once (None: as
    many as the requests; the caller bounds them).

    Idle connections are reused newest first and dropped after ``keepalive`` seconds idle (vLLM's
    uvicorn closes them at 5 s; reusing one it is closing would fail the request). When every slot is
    taken, a request waits (FIFO, up to ``pool_timeout``) for a connection to come back or close.
    """

    def __init__(
        self,
        limit: int | None,
        *,
        connect_timeout: float,
        read_timeout: float | None,
        pool_timeout: float,
        keepalive: float = 2.5,
        ssl_context: ssl.SSLContext | None = None,
        max_header_bytes: int = 64 * 1024,
        max_headers: int = 100,
    ) -> None:
        if limit is not None and limit < 1:
            raise ValueError("limit must be None or >= 1")
        self.limit = limit
        self.limits = Limits(connect_timeout, read_timeout, pool_timeout, max_header_bytes, max_headers)
        self.keepalive = keepalive
        self._ssl = ssl_context
        self._idle: dict[tuple[str, str, int], list[Connection]] = {}
        self._open = 0
        self._waiters: collections.deque[_Waiter] = collections.deque()
        self._all: set[Connection] = set()
        self._closed = False

    @property
    def open_connections(self) -> int:
        return self._open

    @property
    def idle_connections(self) -> int:
        return sum(len(v) for v in self._idle.values())

    async def request(
        self,
        origin: Origin,
        path: bytes,
        headers: list[tuple[bytes, bytes]],
        body: bytes | AsyncIterable[bytes],
        method: bytes = b"POST",
    ) -> Response:
        """Send ``body`` to ``origin`` + ``path``; returns once the status and headers are in.

        A body that is not ``bytes`` is sent as it arrives (chunked, unless ``headers`` give its
        length), on a connection of its own choosing, never sent twice."""
        if not isinstance(body, bytes):
            return await self._stream(origin, path, headers, body, method)
        head = _head(method, origin, path, headers, len(body))
        retried = False
        while True:
            # The common case, a warm idle connection, without another coroutine (not for the retry:
            # another idle one may be closing too).
            idle = (
                None if self._closed or retried else self._pop_idle(origin, asyncio.get_running_loop().time())
            )
            conn, reused = (idle, True) if idle is not None else await self._acquire(origin, fresh=retried)
            r = conn.send(head, body)
            try:
                while not r.headers_done:
                    if r._failure is not None:
                        raise r.failure()
                    await r._wait()
            except RemoteProtocolError:
                r.close()
                if retried or not reused or r.received:
                    raise
                retried = True  # the server closed this idle connection as we sent: once more, fresh
                continue
            except BaseException:
                r.close()
                raise
            return r

    async def _stream(
        self,
        origin: Origin,
        path: bytes,
        headers: list[tuple[bytes, bytes]],
        body: AsyncIterable[bytes],
        method: bytes,
    ) -> Response:
        head = _head(method, origin, path, headers, None)
        chunked = head.endswith(b"transfer-encoding: chunked\r\n\r\n")
        conn, _ = await self._acquire(origin, fresh=True)  # an idle one may be closing as we send
        r = conn.start(head)
        try:
            await conn.write_body(r, body, chunked=chunked)
            while not r.headers_done:
                if r._failure is not None:
                    raise r.failure()
                await r._wait()
        except BaseException:
            r.close()
            raise
        return r

    async def _acquire(self, origin: Origin, fresh: bool = False) -> tuple[Connection, bool]:
        """A connection to ``origin``: an idle one (unless ``fresh``), a new one while under the
        limit, else the first one released or slot freed. One handed over as it is released is
        taken even when ``fresh``: it was just used, so no idle timer of the server's runs on it."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.limits.pool_timeout
        while True:
            if self._closed:  # also for a waiter woken by ``aclose``
                raise ConnectError("the upstream pool is closed")
            conn = None if fresh else self._pop_idle(origin, loop.time())
            if conn is not None:
                return conn, True
            if self.limit is None or self._open < self.limit or self._evict_idle():
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
        return f"no free connection within {self.limits.pool_timeout:g}s (all {self.limit} in use)"

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

    def _pop_idle(self, origin: Origin, now: float) -> Connection | None:
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
        oldest: Connection | None = None
        for stack in self._idle.values():
            if stack and (oldest is None or stack[0].idle_since < oldest.idle_since):
                oldest = stack[0]
        if oldest is None:
            return False
        self._idle[oldest.origin.key].remove(oldest)
        oldest.abort()
        return True

    async def _connect(self, origin: Origin) -> Connection:
        self._open += 1
        loop = asyncio.get_running_loop()
        tls = origin.scheme == "https"
        if tls and self._ssl is None:
            self._ssl = ssl.create_default_context()
        try:
            async with asyncio.timeout(self.limits.connect_timeout):
                _, made = await loop.create_connection(
                    lambda: cast(asyncio.Protocol, Connection(self, origin)),
                    origin.host,
                    origin.port,
                    ssl=self._ssl if tls else None,
                    server_hostname=origin.host if tls else None,
                )
        except TimeoutError:
            self._slot_freed()
            raise ConnectTimeout(
                f"no connection to {origin.host}:{origin.port} within {self.limits.connect_timeout:g}s"
            ) from None
        except (OSError, ssl.SSLError) as exc:
            self._slot_freed()
            raise ConnectError(f"cannot connect to {origin.host}:{origin.port}: {exc}") from exc
        except BaseException:
            self._slot_freed()
            raise
        conn = cast(Connection, made)
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
    def _release(self, conn: Connection) -> None:
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

    def _forget(self, conn: Connection) -> None:
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
        """Close every connection; requests in flight fail with ``RemoteProtocolError``."""
        self._closed = True
        for conn in list(self._all):
            conn.abort()
        for waiter in self._waiters:
            if not waiter.future.done():
                waiter.future.set_result(None)
        self._idle.clear()
        await asyncio.sleep(0)  # let the transports report their loss


#: Every control byte but HTAB (CR and LF included) as NUL: the head's own line ends are two each,
#: so one more anywhere is a byte that would split the request (or smuggle a NUL into it).
_CONTROLS_AS_NUL = bytes(0 if (b < 0x20 and b != 0x09) or b == 0x7F else b for b in range(256))
#: And in the target, any control or space: for the refusal's message.
_TARGET_AS_NUL = bytes(0 if b <= 0x20 or b == 0x7F else b for b in range(256))


def _head(
    method: bytes, origin: Origin, path: bytes, headers: list[tuple[bytes, bytes]], length: int | None
) -> bytes:
    """The request's head, framed by ``length`` (None: chunked, unless ``headers`` give a length);
    ``InvalidRequest`` for a target or header field that would split it (CR, LF, NUL, other
    controls; a space in the target)."""
    parts = [method, b" ", origin.path, path, b" HTTP/1.1\r\nhost: ", origin.authority, b"\r\n"]
    for k, v in headers:  # four appends (native when compiled), no tuple built and concatenated
        parts.append(k)
        parts.append(b": ")
        parts.append(v)
        parts.append(b"\r\n")
    lines = len(headers) + 3  # the request line, host, the empty line
    if origin.basic_auth is not None and not any(k == b"authorization" for k, _ in headers):
        parts += (b"authorization: ", origin.basic_auth, b"\r\n")
        lines += 1
    if length is not None:
        parts += (b"content-length: ", str(length).encode(), b"\r\n\r\n")
        lines += 1
    elif not any(k.lower() == b"content-length" for k, _ in headers):
        parts.append(b"transfer-encoding: chunked\r\n\r\n")
        lines += 1
    else:
        parts.append(b"\r\n")
    head = b"".join(parts)
    # A control anywhere (in the target too) is a NUL beyond the line ends' own; the target may hold
    # no space or HTAB either, which a field's value may.
    if head.translate(_CONTROLS_AS_NUL).count(0) != 2 * lines or b" " in path or b"\t" in path:
        raise InvalidRequest(_refusal(path, headers))
    return head


def _refusal(path: bytes, headers: list[tuple[bytes, bytes]]) -> str:
    if path.translate(_TARGET_AS_NUL).count(0):
        return f"the request target {path[:200]!r} carries a control byte or a space"
    for k, v in headers:
        if (k + v).translate(_CONTROLS_AS_NUL).count(0):
            return f"the header field {k[:100]!r} carries CR, LF or a control byte"
    return "the request's head carries CR, LF or a control byte"
