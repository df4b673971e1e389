"""One request's ASGI exchange on a client connection: the listener's own request/response cycle.

What uvicorn's ``RequestResponseCycle`` does, for a protocol of ``taogate.listener``, at less cost
per request: the request body is kept as the pieces the parser gave (joined only when there are
several), ``receive`` waits on a future made only when nothing has arrived yet, and the response's
header fields are written as the app gives them, with no pattern search per field (ASGI asks the
app for lower-case names; a field that would split the head is still refused, by counting line
ends). The framing is uvicorn's, ``content-length`` or else ``transfer-encoding: chunked`` (none for
HEAD, 204 and 304), except that an HTTP/1.0 client, which knows no chunks, reads to the close;
``connection: close`` is added when the connection will not be kept. The head is
held until the body's first piece or the end of this turn of the loop, whichever comes first, so a
response leaves in one write; the app's failures are answered and logged as uvicorn does (its
logger, its messages: ``taogate.observe.dropped`` filters one of them).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any, Protocol

import httptools
from uvicorn.protocols.http.flow_control import HIGH_WATER_LIMIT, FlowControl
from uvicorn.protocols.http.httptools_impl import STATUS_LINE

__all__ = ["METHODS", "Connection", "Cycle", "request_target"]

ASGIApp = Callable[..., Awaitable[Any]]

#: uvicorn's logger for a failing app, and its messages, which operators (and filters) know.
log = logging.getLogger("uvicorn.error")

#: Above this, a response body is written apart from its held head instead of copied to join it.
_JOIN_UNDER = 65536
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
_CONTENT_LENGTH = b"content-length"
_TRANSFER_ENCODING = b"transfer-encoding"
_CONNECTION = b"connection"
_NO_BODY = frozenset((204, 304))
_FRAMING = frozenset((_CONTENT_LENGTH, _TRANSFER_ENCODING, _CONNECTION))
#: The methods clients use, decoded once (a scope's ``method`` is a str).
METHODS = {m.encode(): m for m in ("GET", "POST", "HEAD", "PUT", "DELETE", "OPTIONS", "PATCH")}
_SERVER_ERROR_HEAD: dict[str, Any] = {
    "type": "http.response.start",
    "status": 500,
    "headers": [
        (b"content-type", b"text/plain; charset=utf-8"),
        (b"content-length", b"21"),
        (b"connection", b"close"),
    ],
}
_SERVER_ERROR_BODY: dict[str, Any] = {
    "type": "http.response.body",
    "body": b"Internal Server Error",
    "more_body": False,
}


class Connection(Protocol):
    """What a cycle asks of its client connection (``taogate.listener.LimitedProtocol``)."""

    transport: asyncio.Transport
    flow: FlowControl
    server_state: Any  # uvicorn's ServerState: ``default_headers``
    loop: asyncio.AbstractEventLoop

    @property
    def write_stall(self) -> float | None:
        """Seconds a write may wait for a client that reads nothing before it is dropped."""

    def close_after_response(self) -> None:
        """The connection is not kept: end it after this response (lingering while the body comes)."""

    def on_response_complete(self) -> None:
        """The response is all written: the next request may be served."""


class Cycle:
    """The request ``scope`` of ``protocol``'s connection, its body as it arrives, its response.

    The protocol feeds the body (``on_body``, ``on_end``) and says when the client is gone
    (``on_lost``); ``run`` serves the request with an ASGI app. The cycle holds the protocol only
    while ``run`` runs: the protocol holds its latest cycle, and a strong reference back would make
    every connection a reference cycle, freed only by a full collection."""

    __slots__ = (
        "_chunks",
        "_expected",
        "_head",
        "_head_only",
        "_loop",
        "_protocol",
        "_ready",
        "_size",
        "_waiters",
        "chunked",
        "disconnected",
        "flow",
        "keep_alive",
        "more_body",
        "response_complete",
        "response_started",
        "scope",
        "server_state",
        "transport",
        "waiting_for_100_continue",
    )

    def __init__(
        self, protocol: Connection, scope: dict[str, Any], keep_alive: bool, expect_100_continue: bool
    ) -> None:
        self._protocol: Connection | None = protocol
        self.scope = scope
        self.transport: asyncio.Transport = protocol.transport
        self.flow: FlowControl = protocol.flow
        self.server_state = protocol.server_state
        self._loop = protocol.loop
        self.keep_alive = keep_alive
        self.waiting_for_100_continue = expect_100_continue
        self.disconnected = False
        self.more_body = True
        self.response_started = False
        self.response_complete = False
        self.chunked: bool | None = None
        self._expected = 0
        self._head_only = scope["method"] == "HEAD"
        self._head: bytes | None = None
        self._chunks: list[bytes] = []
        self._size = 0
        self._ready = False  # something for receive(): a body piece, the body's end, the end
        self._waiters: list[asyncio.Future[None]] | None = None

    # -- fed by the protocol -------------------------------------------------------------------
    def on_body(self, body: bytes) -> None:
        self._chunks.append(body)
        self._size += len(body)
        if self._size > HIGH_WATER_LIMIT:
            self.flow.pause_reading()
        self._ready = True
        if self._waiters is not None:
            self._wake()

    def on_end(self) -> None:
        self.more_body = False
        self._ready = True
        if self._waiters is not None:
            self._wake()

    def on_lost(self) -> None:
        if not self.response_complete:
            self.disconnected = True
        self._ready = True
        if self._waiters is not None:
            self._wake()

    def _wake(self) -> None:
        waiters, self._waiters = self._waiters, None
        for waiter in waiters or ():
            if not waiter.done():
                waiter.set_result(None)

    # -- the app -------------------------------------------------------------------------------
    async def run(self, app: ASGIApp, tasks: set[asyncio.Task[None]]) -> None:
        """Serve the request with ``app``; what it leaves undone is logged, answered or closed.
        Ends by leaving ``tasks``, the server's (cheaper than a done callback)."""
        try:
            result = await app(self.scope, self.receive, self.send)
        except BaseException as exc:
            log.error("Exception in ASGI application\n", exc_info=exc)
            if not self.response_started:
                await self._send_500()
            else:
                self._close()
        else:
            if result is not None:
                log.error("ASGI callable should return None, but returned '%s'.", result)
                self._close()
            elif not self.response_started and not self.disconnected:
                log.error("ASGI callable returned without starting response.")
                await self._send_500()
            elif not self.response_complete and not self.disconnected:
                log.error("ASGI callable returned without completing response.")
                self._close()
        finally:
            self._protocol = None
            tasks.discard(asyncio.current_task(self._loop))

    async def _send_500(self) -> None:
        await self.send(_SERVER_ERROR_HEAD)
        await self.send(_SERVER_ERROR_BODY)

    async def receive(self) -> dict[str, Any]:
        if self.waiting_for_100_continue and not self.transport.is_closing():
            self.transport.write(_CONTINUE)
            self.waiting_for_100_continue = False
        if not self.disconnected and not self.response_complete:
            if self.flow.read_paused:
                self.flow.resume_reading()
            if not self._ready:
                waiter = self._loop.create_future()
                if self._waiters is None:
                    self._waiters = [waiter]
                else:
                    self._waiters.append(waiter)
                await waiter
            self._ready = False
        if self.disconnected or self.response_complete:
            return {"type": "http.disconnect"}
        chunks = self._chunks
        if not chunks:
            body = b""
        elif len(chunks) == 1:
            body = chunks[0]
            chunks.clear()
        else:
            body = b"".join(chunks)
            chunks.clear()
        self._size = 0
        return {"type": "http.request", "body": body, "more_body": self.more_body}

    async def send(self, message: MutableMapping[str, Any]) -> None:
        if self.flow.write_paused and not self.disconnected:
            await self._drained()
        if self.disconnected:
            return
        kind = message["type"]
        if not self.response_started:
            if kind != "http.response.start":
                raise RuntimeError(f"Expected ASGI message 'http.response.start', but got {kind!r}.")
            self.response_started = True
            self.waiting_for_100_continue = False
            self._start(message["status"], message.get("headers", ()))
        elif not self.response_complete:
            if kind != "http.response.body":
                raise RuntimeError(f"Expected ASGI message 'http.response.body', but got {kind!r}.")
            self._body(message.get("body", b""), message.get("more_body", False))
        else:
            raise RuntimeError(f"Unexpected ASGI message {kind!r} sent, after the response completed.")

    async def _drained(self) -> None:
        """Until the client has taken what is buffered. One that takes nothing for the listener's
        ``write_stall`` is dropped: the connection aborted, the app told it is gone."""
        protocol = self._protocol
        try:
            async with asyncio.timeout(protocol.write_stall if protocol is not None else None):
                await self.flow.drain()
        except TimeoutError:
            self.disconnected = True
            self.transport.abort()

    # -- the response --------------------------------------------------------------------------
    def _start(self, status: int, headers: Any) -> None:
        parts = [STATUS_LINE[status]]
        fields = self.server_state.default_headers
        for name, value in fields:
            parts += (name, b": ", value, b"\r\n")
        lines = len(fields) + 2  # the status line and the blank line that ends the head
        close = False
        for name, value in headers:
            if name in _FRAMING:
                if name == _CONTENT_LENGTH:
                    if self.chunked is None:
                        self._expected = int(value.decode())
                        self.chunked = False
                elif name == _TRANSFER_ENCODING:
                    if value.lower() == b"chunked":
                        self._expected = 0
                        self.chunked = True
                elif b"close" in [token.lower().strip() for token in value.split(b",")]:
                    self.keep_alive = False
                    close = True
            parts += (name, b": ", value, b"\r\n")
            lines += 1
        if not self.keep_alive and not close:
            parts.append(b"connection: close\r\n")
            lines += 1
        if self.chunked is None and not self._head_only and status not in _NO_BODY:
            if self.scope.get("http_version") == "1.0":  # it knows no chunks: the close ends it
                self.chunked, self._expected = False, -1
            else:
                self.chunked = True
                parts.append(b"transfer-encoding: chunked\r\n")
                lines += 1
        parts.append(b"\r\n")
        head = b"".join(parts)
        if head.count(b"\n") != lines or head.count(b"\r") != lines:
            raise RuntimeError("Invalid HTTP header value.")  # a line end inside a field
        self._head = head
        self._loop.call_soon(self._flush)

    def _body(self, body: bytes, more_body: bool) -> None:
        if self._head_only:
            self._expected = 0
        elif self.chunked:
            if body:
                framed = b"%x\r\n%b\r\n" if more_body else b"%x\r\n%b\r\n0\r\n\r\n"
                self._write(framed % (len(body), body))
            else:
                self._write(b"" if more_body else b"0\r\n\r\n")
        elif self._expected >= 0:
            if len(body) > self._expected:
                raise RuntimeError("Response content longer than Content-Length")
            self._expected -= len(body)
            self._write(body)
        else:  # an HTTP/1.0 answer of no stated length
            self._write(body)
            if not more_body:
                self._expected = 0
        if not more_body:
            if self._expected != 0:
                raise RuntimeError("Response content shorter than Content-Length")
            self.response_complete = True
            if self._head is not None:
                self._flush()
            self._ready = True
            if self._waiters is not None:
                self._wake()
            protocol = self._protocol
            if protocol is not None:
                if not self.keep_alive:
                    protocol.close_after_response()
                protocol.on_response_complete()

    def _write(self, data: bytes) -> None:
        head = self._head
        if head is None:
            if data:
                self.transport.write(data)
            return
        self._head = None
        if len(data) < _JOIN_UNDER:
            self.transport.write(head + data)
        else:  # a large body is not copied to be joined
            self.transport.write(head)
            self.transport.write(data)

    def _flush(self) -> None:
        head = self._head
        if head is not None:
            self._head = None
            if not self.transport.is_closing():  # the client may have gone since the head was held
                self.transport.write(head)

    def _close(self) -> None:
        """The response is left unfinished: the connection ends. With bytes still waiting for the
        client (it stopped reading), a close would wait for it to read them, for ever: aborted."""
        if self.transport.get_write_buffer_size():
            self._head = None
            self.transport.abort()
            return
        self._flush()
        protocol = self._protocol
        if protocol is not None:
            protocol.close_after_response()


def request_target(url: bytes) -> tuple[bytes, bytes]:
    """The path and the query of a request target, as ``httptools.parse_url`` gives them; an
    origin-form target without a fragment (what clients send) is split without building a URL."""
    if url[:1] == b"/" and b"#" not in url:
        path, _, query = url.partition(b"?")
        return path, query
    parsed: Any = httptools.parse_url(url)  # its stub says bytes; the query is None when absent
    return parsed.path, parsed.query or b""
