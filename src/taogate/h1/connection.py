"""One keep-alive connection to an instance (an asyncio protocol parsing with httptools), and the
``Response`` it feeds: status and headers, then the body chunk by chunk with flow control."""

from __future__ import annotations

import asyncio
import collections
from collections.abc import AsyncIterator
from typing import Final, Protocol, cast

import httptools
from httpx import ReadTimeout, RemoteProtocolError, TransportError

from .origin import Origin

__all__ = ["Connection", "Owner", "Response"]

_HIGH_WATER: Final = 256 * 1024  # buffered body bytes at which reading pauses (until drained)


class Owner(Protocol):
    """What a connection needs from its pool."""

    @property
    def read_timeout(self) -> float | None: ...

    def _release(self, conn: Connection) -> None: ...

    def _forget(self, conn: Connection) -> None: ...


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

    def __init__(self, conn: Connection) -> None:
        self._conn: Connection | None = conn
        self.status_code = 0
        self.raw_headers: list[tuple[bytes, bytes]] = []
        self.headers_done = False
        self.complete = False
        self.keep_alive = False
        self.received = False  # any byte of the reply arrived
        self._chunks: collections.deque[bytes] = collections.deque()
        self._buffered = 0
        self._error: TransportError | None = None
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
            data = self._take()
            self.close()
            return data
        parts = [chunk async for chunk in self.aiter_raw()]
        return parts[0] if len(parts) == 1 else b"".join(parts)

    async def aiter_raw(self) -> AsyncIterator[bytes]:
        """The body as it arrives (de-chunked), whatever is buffered joined into one piece."""
        while True:
            if self._chunks:
                data = self._take()
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

    def _take(self) -> bytes:
        """Everything buffered, as one piece; the buffer is empty after."""
        chunks = self._chunks
        data = chunks.popleft() if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        self._buffered = 0
        return data

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

    def _fail(self, error: TransportError) -> None:
        if self._error is None and not self.complete:
            self._error = error
        self._wake()


class Connection(asyncio.Protocol):
    """One keep-alive connection to one origin; at most one request at a time."""

    def __init__(self, pool: Owner, origin: Origin) -> None:
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
            r._fail(
                RemoteProtocolError(f"malformed response from {self.origin.host}:{self.origin.port}: {exc}")
            )
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
        r._fail(RemoteProtocolError(f"connection closed before a complete answer{why}"))

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
