"""One keep-alive connection to an instance: an asyncio protocol parsing with httptools, feeding
its ``Response`` (``h1.response``); a request body held whole, or sent as it arrives.

Whatever httptools raises (a malformed reply, a ``101 Switching Protocols``, which is not even an
``HttpParserError``, a head over the pool's limits) fails the response with ``MalformedResponse``
and aborts the connection: never an exception out of ``data_received``, which the loop would log
with a traceback. A head is bounded by counting the bytes fed while it has not ended, because
httptools accumulates a header value by concatenation before any callback sees it. Trailers are
not headers (RFC 9110 §6.5.1): they are dropped."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterable
from typing import Final, Protocol, cast

import httptools

from .errors import MalformedResponse, ReadTimeout, RemoteProtocolError, WriteError, WriteTimeout
from .limits import Limits
from .origin import Origin
from .response import HIGH_WATER, Response

__all__ = ["Connection", "Owner"]

_MAX_INTERIM: Final = 8  # 1xx replies before the answer (100 Continue, 103 Early Hints)


class _Refused(Exception):
    """Raised in a parser callback: the reply breaks a limit (the message says which)."""


class Owner(Protocol):
    """What a connection needs from its pool."""

    @property
    def limits(self) -> Limits: ...

    def _release(self, conn: Connection) -> None: ...

    def _forget(self, conn: Connection) -> None: ...


class Connection:
    """One keep-alive connection to one origin; at most one request at a time.

    An asyncio protocol by its methods, not by subclassing ``asyncio.Protocol``: the event loops
    (asyncio's, uvloop's, their TLS layers) call a protocol's methods by name, and a class with no
    Python base compiles to a native class, whose attributes are read without a dict look-up."""

    def __init__(self, pool: Owner, origin: Origin) -> None:
        self.pool = pool
        self.origin = origin
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        # The parser holds our callbacks, so this is a reference cycle until connection_lost drops it.
        self.parser: httptools.HttpResponseParser | None = httptools.HttpResponseParser(self)
        self.response: Response | None = None
        self.counted = True  # holds one of the pool's connection slots
        self.closed = False
        self.reusable = True
        self.paused = False
        self.idle_since = 0.0
        self.last_read = 0.0
        # The read timeout's timer, and when it fires: kept from one reply to the next (a timer that
        # fires early only re-arms for the time left), so a reply on a warm connection makes none.
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0
        self._writable: asyncio.Future[None] | None = None  # set while the transport's buffer is full
        self._interim = False  # parsing a 1xx reply (100 Continue, 103 Early Hints): skipped
        self._extra = False  # a second reply to one request: ignored, the connection not reused
        self._progress = False  # the parser got past a head, a body piece or a message this read
        self._stalled = 0  # bytes fed since it last did
        self._fields = 0
        self._interims = 0

    # -- asyncio.Protocol ----------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's are not asyncio subclasses

    def data_received(self, data: bytes) -> None:
        r, parser = self.response, self.parser
        if r is None or parser is None:  # bytes nobody asked for: the framing can't be trusted
            self.abort()
            return
        self.last_read = self.loop.time()
        r.received = True
        self._progress = False
        try:
            parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._refuse(r, "answered 101 Switching Protocols (upgrades are not proxied)")
            return
        except httptools.HttpParserCallbackError as exc:
            cause = exc.__context__
            self._refuse(r, str(cause) if isinstance(cause, _Refused) else f"sent a malformed answer: {exc}")
            return
        except httptools.HttpParserError as malformed:
            self._refuse(r, f"sent a malformed answer: {malformed}")
            return
        except Exception as failure:  # never out of data_received: the loop would log a traceback
            self._refuse(r, f"sent an answer the parser failed on ({type(failure).__name__}: {failure})")
            return
        if self._progress:
            self._stalled = 0
            return
        self._stalled += len(data)  # a head (or trailers) that has not ended yet
        limit = self.pool.limits.max_header_bytes
        if self._stalled > limit:
            self._refuse(r, f"sent a response head over {limit} bytes")

    def _refuse(self, r: Response, why: str) -> None:
        r._fail(MalformedResponse, f"{self.origin.host}:{self.origin.port} {why}")
        self.abort()

    def eof_received(self) -> None:
        """None: the transport closes, and ``connection_lost`` follows (``asyncio.Protocol``'s)."""

    def pause_writing(self) -> None:
        if self._writable is None:
            self._writable = self.loop.create_future()

    def resume_writing(self) -> None:
        fut, self._writable = self._writable, None
        if fut is not None and not fut.done():
            fut.set_result(None)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.resume_writing()  # a body being sent stops at its next chunk
        self.parser = None  # the cycle through its callbacks: refcounting frees this connection now
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
        r._fail(RemoteProtocolError, f"connection closed before a complete answer{why}")

    # -- httptools callbacks -------------------------------------------------------------------
    def on_message_begin(self) -> None:
        self._fields = 0
        r = self.response
        if r is not None and r.headers_done:  # a reply nobody asked for: framing can't be trusted
            self._extra = True
            r.keep_alive = False

    def on_header(self, name: bytes, value: bytes) -> None:
        r = self.response
        assert r is not None
        if self._extra or r.headers_done:
            return  # an extra reply's, or a trailer field (never merged into the headers)
        self._fields += 1
        if self._fields > self.pool.limits.max_headers:
            raise _Refused(f"sent more than {self.pool.limits.max_headers} response header fields")
        r.raw_headers.append((name.lower(), value))  # once here, not at each look-up

    def on_headers_complete(self) -> None:
        r = self.response
        assert r is not None
        self._progress = True
        parser = self.parser
        assert parser is not None  # called from feed_data, before any connection_lost
        status = parser.get_status_code()
        if self._extra:
            return
        if not 100 <= status < 600:  # httptools takes any three digits
            raise _Refused(f"sent status {status}, outside HTTP's 100-599")
        if status < 200:
            self._interim = True
            self._interims += 1
            if self._interims > _MAX_INTERIM:
                raise _Refused(f"sent more than {_MAX_INTERIM} interim (1xx) replies")
            r.raw_headers.clear()
            return
        r.status_code = status
        r.keep_alive = parser.should_keep_alive()
        r.headers_done = True
        r.deadline = None  # the head is in; the body's own deadline, if any, is the reader's
        r._wake()

    def on_body(self, body: bytes) -> None:
        r = self.response
        assert r is not None
        self._progress = True
        if self._extra:
            return
        r._chunks.append(body)
        r._buffered += len(body)
        if r._buffered > HIGH_WATER and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()
        r._wake()

    def on_message_complete(self) -> None:
        r = self.response
        assert r is not None
        self._progress = True
        if self._interim:
            self._interim = False
            return
        if self._extra:
            return
        parser = self.parser
        assert parser is not None  # called from feed_data, before any connection_lost
        r.complete = True
        r.keep_alive = r.keep_alive and parser.should_keep_alive()
        r._wake()  # the timer stays, for this connection's next reply (``arm_timer``)

    # -- the connection's life -----------------------------------------------------------------
    def send(self, head: bytes, body: bytes) -> Response:
        """Send a request whose body is all here; its response to come."""
        assert self.transport is not None and self.response is None
        r = Response(self)
        self.response = r
        self._interims = 0
        self.last_read = now = self.loop.time()
        timeout = self.pool.limits.read_timeout
        if timeout is not None:  # the head in all, not only between reads: a trickle ends too
            r.deadline = now + timeout
        if len(body) < 65536:  # one write; a large body is not copied to be joined
            self.transport.write(head + body)
        else:
            self.transport.write(head)
            self.transport.write(body)
        return r

    def body_sent(self) -> None:
        """The request is all sent: the answer's head is due within the read timeout, in all (not
        only between reads: a trickle ends too)."""
        self.last_read = now = self.loop.time()
        timeout = self.pool.limits.read_timeout
        r = self.response
        if timeout is not None and r is not None:
            r.deadline = now + timeout

    def start(self, head: bytes) -> Response:
        """Send a request's head; its body follows (``write_body``)."""
        assert self.transport is not None and self.response is None
        r = Response(self)
        self.response = r
        self._interims = 0
        self.transport.write(head)
        return r

    async def write_body(self, r: Response, body: AsyncIterable[bytes], chunked: bool) -> None:
        """Send a body as it arrives, as fast as the instance reads it (each wait for room at most
        the read timeout: ``WriteTimeout``). An instance that answers first gets none of the rest,
        and the connection is not reused; one that hangs up first: ``WriteError``. The body's own
        exceptions propagate."""
        transport = self.transport
        assert transport is not None
        whole = False
        try:
            async for chunk in body:
                if self.closed and not r.headers_done:
                    where = f"{self.origin.host}:{self.origin.port}"
                    raise WriteError(f"{where} closed the connection while the request body was sent")
                if self.closed or r.complete or r._failure is not None:
                    break
                if chunk:
                    transport.write(b"%x\r\n%s\r\n" % (len(chunk), chunk) if chunked else chunk)
                    if self._writable is not None:
                        await self._drain()
            else:
                whole = True
                if chunked and not self.closed:
                    transport.write(b"0\r\n\r\n")
        finally:
            if not whole:  # stopped early or failed: the instance still waits for the rest, and
                self.reusable = False  # would read the next request on this connection as it
        self.body_sent()

    async def _drain(self) -> None:
        fut = self._writable
        timeout = self.pool.limits.read_timeout
        if fut is None:
            return
        try:
            async with asyncio.timeout(timeout):
                await asyncio.shield(fut)
        except TimeoutError:
            where = f"{self.origin.host}:{self.origin.port}"
            raise WriteTimeout(f"{where} read none of the request body for {timeout:g}s") from None

    def resume(self) -> None:
        self.paused = False
        if self.transport is not None and not self.closed:
            self.transport.resume_reading()

    def arm_timer(self) -> None:
        """The read timeout's timer, due by the response's deadline: one already due no later stays
        (``_check`` re-arms it for the time left when it fires)."""
        timeout = self.pool.limits.read_timeout
        if timeout is None:
            return
        at = self.loop.time() + timeout
        r = self.response
        if r is not None and r.deadline is not None and r.deadline < at:
            at = r.deadline
        timer = self._timer
        if timer is not None:
            if self._timer_at <= at:
                return
            timer.cancel()  # due later than this reply allows: a lowered timeout (a reload)
        self._arm(at)

    def _arm(self, at: float) -> None:
        self._timer = self.loop.call_at(at, self._check)
        self._timer_at = at

    def rearm_timer(self) -> None:
        """Time again from now (a response's deadline moved earlier)."""
        self._cancel_timer()
        self.arm_timer()

    def _check(self) -> None:
        """The read timeout: silence while the consumer waits; a consumer busy elsewhere (a slow
        client downstream) is not the instance's silence."""
        self._timer = None
        r = self.response
        timeout = self.pool.limits.read_timeout
        if r is None or r.complete or r._failure is not None or timeout is None:
            return
        now = self.loop.time()
        if r._waiter is None:
            self._arm(now + timeout)
            return
        deadline = max(self.last_read, r._wait_started) + timeout
        total = r.deadline
        if total is not None and total < deadline:
            deadline = total
        if now < deadline:
            self._arm(deadline)
            return
        where = f"{self.origin.host}:{self.origin.port}"
        if now - max(self.last_read, r._wait_started) >= timeout:
            r._fail(ReadTimeout, f"no data from {where} for {timeout:g}s")
        else:
            r._fail(ReadTimeout, f"{where} kept trickling: no complete answer in time")
        self.abort()

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def release(self) -> None:
        """The reply was read to its end: back to the pool (its timer kept for the next reply)."""
        self.response = None
        if self.closed or not self.reusable or self.transport is None or self.transport.is_closing():
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
        if k == b"content-length" or (k == b"transfer-encoding" and b"chunked" in v.lower()):
            return True
    return False
