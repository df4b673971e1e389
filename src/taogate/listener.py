"""What one client connection may cost: uvicorn's httptools protocol, with limits.

uvicorn bounds none of this itself: httptools grows a header value by concatenation per read (a huge
head costs the square of its size before any callback can object), no timer is armed until a first
response is done, trailers are merged into the headers, and connections are accepted until the
process runs out of file descriptors. ``protocol_class(limits)`` returns a subclass that counts the
bytes fed to the parser, bounds the URL, head and fields, times the head, drops trailers and caps
the connections (shedding a lingering or the longest-idle one), answering in OpenAI's error shape
with ``connection: close`` (414, 431, 408, 400). A connection closed before its request's body is
all in lingers a moment, reading and discarding, so the client reads the answer instead of a reset.
A response's head goes out with its body in one write. The uvicorn internals this relies on are
pinned by ``tests/unit/test_listener.py``.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, ClassVar, cast

import httptools
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from taogate.errors import error_body

__all__ = ["LimitedProtocol", "ListenerLimits", "protocol_class"]

log = logging.getLogger("taogate.listener")

#: A connection closed before its request was all in is still read (and discarded) while the
#: client sends, for up to ``_LINGER_S`` in all and ``_LINGER_IDLE_S`` between reads (nginx's
#: lingering close), so the client reads the answer instead of a reset; after a refused head, only
#: up to ``_LINGER_BYTES``.
_LINGER_S = 30.0
_LINGER_IDLE_S = 5.0
_LINGER_BYTES = 256 * 1024
#: Seconds between two warnings of one kind (the count in between is reported).
_WARN_EVERY_S = 10.0


@dataclass(frozen=True, slots=True)
class ListenerLimits:
    max_header_bytes: int = 64 * 1024
    max_headers: int = 100
    max_url_bytes: int = 8 * 1024
    header_timeout: float = 10.0
    max_connections: int = 4096


class _Reject(Exception):
    """Raised in a parser callback: the request is answered ``status`` and the connection closed."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message


@dataclass(slots=True)
class _Listener:
    """State shared by one server's connections."""

    limits: ListenerLimits
    idle: dict[LimitedProtocol, None] = field(default_factory=dict)  # oldest first
    lingering: dict[LimitedProtocol, None] = field(default_factory=dict)
    _warned: dict[str, tuple[float, int]] = field(default_factory=dict)

    def warn(self, kind: str, message: str) -> None:
        """A warning per kind at most every few seconds, with how many were not logged."""
        now = time.monotonic()
        last, skipped = self._warned.get(kind, (0.0, 0))
        if now - last < _WARN_EVERY_S:
            self._warned[kind] = (last, skipped + 1)
            return
        self._warned[kind] = (now, 0)
        more = f" ({skipped} more since the last such warning)" if skipped else ""
        log.warning("%s%s", message, more)

    def shed(self, newcomer: LimitedProtocol) -> bool:
        """Close a lingering connection, else the longest-idle one, to make room; False when none
        is either."""
        for pool in (self.lingering, self.idle):
            for victim in pool:
                if victim is not newcomer:
                    del pool[victim]
                    victim.transport.abort()  # close() would wait for a client that does not read
                    return True
        return False


class _CycleTransport:
    """What one request's cycle writes to: the connection's transport, whose ``close`` lingers
    while the request body is still coming (uvicorn's cycle only writes, asks and closes).

    The cycle's first write (the response head) is held until its next write (the body) or the end
    of this turn of the loop, whichever comes first: uvicorn writes the head and the body apart, and
    one write(2) per response instead of two saves a syscall and a TCP segment each (measured:
    benchmarks/overhead.py).

    It holds the protocol weakly: the protocol holds the cycle, and a strong reference back would
    make every connection a reference cycle, freed only by a full collection, so a burst of
    connections would stay in memory long after it closed. Once the connection is gone (the
    protocol with it), a close has nothing left to do."""

    __slots__ = ("_held", "_loop", "_protocol", "_transport", "_wrote", "is_closing")

    def __init__(self, protocol: LimitedProtocol) -> None:
        self._protocol = weakref.ref(protocol)
        self._transport = protocol.transport
        self._loop = protocol.loop
        self._held: bytes | None = None
        self._wrote = False
        self.is_closing = protocol.transport.is_closing

    def write(self, data: bytes) -> None:
        held = self._held
        if held is not None:
            self._held = None
            if len(data) < 65536:
                self._transport.write(held + data)
            else:  # a large body is not copied to be joined
                self._transport.write(held)
                self._transport.write(data)
        elif self._wrote:
            self._transport.write(data)
        else:
            self._wrote = True
            self._held = data
            self._loop.call_soon(self.flush)

    def flush(self) -> None:
        held = self._held
        if held is not None:
            self._held = None
            if not self._transport.is_closing():  # the client may have gone since the head was held
                self._transport.write(held)

    def close(self) -> None:
        self.flush()
        protocol = self._protocol()
        if protocol is not None:
            protocol._close_after_response()


class LimitedProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the limits of ``_listener`` (see the module docstring)."""

    _listener: ClassVar[_Listener]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._limits = self._listener.limits
        self._head_started = False  # a request's head has begun and not ended
        self._progress = False  # the parser got past a head, a body piece or a message this read
        self._stalled = 0  # bytes fed since the parser last made progress
        self._url_parts: list[bytes] = []
        self._url_len = 0
        self._fields = 0
        self._head_size = 0
        self._saw_bytes = False
        self._timer: asyncio.TimerHandle | None = None
        self._rejected = False  # answered for good: what still arrives is discarded
        self._discarded = 0
        self._linger_bytes = 0.0
        self._linger_end = self._last_read = 0.0
        self._body_done = True  # the current request's message has ended

    # -- the connection ------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        listener = self._listener
        if len(self.connections) > self._limits.max_connections and not listener.shed(self):
            listener.warn(
                "refused",
                f"client connection refused: {self._limits.max_connections} connections are open "
                "and none is idle ([gateway] max_client_connections)",
            )
            transport.abort()
            return
        listener.idle[self] = None
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel()
        self._listener.idle.pop(self, None)
        self._listener.lingering.pop(self, None)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        # uvicorn's own, with the byte count and the rejections of this class.
        if self._rejected:  # lingering: discarded, up to a point
            self._discarded += len(data)
            self._last_read = self.loop.time()
            if self._discarded > self._linger_bytes:
                self.transport.abort()
            return
        self._unset_keepalive_if_required()
        self._saw_bytes = True
        self._progress = False
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserCallbackError as exc:
            cause = exc.__context__
            if isinstance(cause, _Reject):
                self._reject(cause)
            else:
                self._reject(_Reject(400, "invalid_http_request", "Invalid HTTP request received."))
            return
        except httptools.HttpParserError:
            self._reject(_Reject(400, "invalid_http_request", "Invalid HTTP request received."))
            return
        except httptools.HttpParserUpgrade:
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()
            return
        if self._head_started and self._timer is None:
            self._arm()  # a head left unfinished by this read, on a kept-alive connection
        if self._progress:
            self._stalled = 0
            return
        # No head, body piece or message end in this read: a head (or a trailer section, or a
        # chunk-size line) that does not end. Stops httptools' quadratic accumulation early.
        self._stalled += len(data)
        if self._stalled > self._limits.max_header_bytes:
            self._reject(_too_large(self._limits))

    # -- parser callbacks ----------------------------------------------------------------------
    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._head_started = True
        self._url_parts = []
        self._url_len = self._fields = self._head_size = 0

    def on_url(self, url: bytes) -> None:
        # Called per fragment; uvicorn's `self.url += url` would copy the URL so far each time.
        self._url_len += len(url)
        if self._url_len > self._limits.max_url_bytes:
            raise _Reject(
                414, "uri_too_long", f"The request target exceeds {self._limits.max_url_bytes} bytes."
            )
        self._url_parts.append(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        if not self._head_started:
            return  # a trailer field: never merged into the request's headers
        self._fields += 1
        self._head_size += len(name) + len(value) + 4
        limits = self._limits
        if self._fields > limits.max_headers:
            raise _Reject(431, "too_many_headers", f"More than {limits.max_headers} request header fields.")
        if self._head_size + self._url_len > limits.max_header_bytes:
            raise _too_large(limits)
        # uvicorn's own, written out: a call less per field
        name = name.lower()
        if name == b"expect" and value.lower() == b"100-continue":
            self.expect_100_continue = True
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        parts = self._url_parts
        self.url = parts[0] if len(parts) == 1 else b"".join(parts)
        self._head_started = self._body_done = False
        self._progress = True
        self._cancel()
        self._listener.idle.pop(self, None)
        transport = self.transport
        self.transport = cast(asyncio.Transport, _CycleTransport(self))  # what the new cycle keeps
        try:
            super().on_headers_complete()
        finally:
            self.transport = transport

    def on_body(self, body: bytes) -> None:
        self._progress = True
        super().on_body(body)

    def on_chunk_complete(self) -> None:
        self._progress = True

    def on_message_complete(self) -> None:
        self._progress = self._body_done = True
        super().on_message_complete()

    def on_response_complete(self) -> None:
        queued = bool(self.pipeline)
        super().on_response_complete()
        if not queued and not self.transport.is_closing() and not self._rejected:
            idle = self._listener.idle
            idle.pop(self, None)
            idle[self] = None  # the most recently idle, last

    def _unsupported_upgrade_warning(self) -> None:
        self._listener.warn("upgrade", "a client asked to upgrade the connection; it stays HTTP/1.1")

    # -- timers and rejections -----------------------------------------------------------------
    def _arm(self) -> None:
        self._timer = self.loop.call_later(self._limits.header_timeout, self._head_timeout)

    def _cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _head_timeout(self) -> None:
        self._timer = None
        if self.transport.is_closing() or self._rejected:
            return
        if not self._saw_bytes:
            self.transport.close()  # said nothing: nothing to answer
            return
        if not self._head_started:
            return
        if self.cycle is not None and not self.cycle.response_complete:
            self._arm()  # the next head came early, behind a request still running
            return
        self._reject(
            _Reject(
                408,
                "header_timeout",
                f"The request head was not received within {self._limits.header_timeout:g}s.",
            )
        )

    def _reject(self, rejection: _Reject) -> None:
        """Answer (unless a response is under way: then only close), read and discard what the
        client still sends for a moment, then close."""
        self._cancel()
        self._rejected = True
        self._listener.warn(rejection.code, f"client request refused: {rejection.message}")
        transport = self.transport
        if self.cycle is not None and not self.cycle.response_complete:
            transport.close()
            return
        body = error_body(rejection.message, "invalid_request_error", rejection.code)
        head = [STATUS_LINE[rejection.status]]
        for name, value in self.server_state.default_headers:
            head += [name, b": ", value, b"\r\n"]
        head += [
            b"content-type: application/json\r\ncontent-length: ",
            str(len(body)).encode(),
            b"\r\nconnection: close\r\n\r\n",
            body,
        ]
        transport.write(b"".join(head))
        self._linger(_LINGER_BYTES)

    def _close_after_response(self) -> None:
        if self.transport.is_closing():
            return
        if self._body_done:
            self.transport.close()
        else:
            self._rejected = True
            self._linger(math.inf)

    def _linger(self, max_bytes: float) -> None:
        """End our side after what was written; discard what still comes for a while, then close.
        A lingering connection is the first to go when the connection cap is reached."""
        transport = self.transport
        if not transport.can_write_eof():
            transport.close()
            return
        transport.write_eof()
        self.flow.resume_reading()  # the app may have left the body unread: read it to discard
        self._linger_bytes = max_bytes
        self._last_read = now = self.loop.time()
        self._linger_end = now + _LINGER_S
        self._cancel()
        self._timer = self.loop.call_at(now + _LINGER_IDLE_S, self._lingered)
        self._listener.idle.pop(self, None)
        self._listener.lingering[self] = None

    def _lingered(self) -> None:
        due = min(self._linger_end, self._last_read + _LINGER_IDLE_S)
        if self.loop.time() >= due:
            self._timer = None
            self.transport.abort()
        else:
            self._timer = self.loop.call_at(due, self._lingered)


def _too_large(limits: ListenerLimits) -> _Reject:
    return _Reject(431, "header_too_large", f"The request head exceeds {limits.max_header_bytes} bytes.")


def protocol_class(limits: ListenerLimits) -> type[LimitedProtocol]:
    """A protocol class for one server (its connections share the cap and the idle order)."""
    return cast(
        type[LimitedProtocol],
        type("LimitedProtocol", (LimitedProtocol,), {"_listener": _Listener(limits)}),
    )
