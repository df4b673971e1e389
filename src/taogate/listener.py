"""The client-facing protocol: uvicorn's httptools protocol, with limits and a cycle of ours.

uvicorn bounds none of this itself: httptools grows a header value by concatenation per read (a huge
head costs the square of its size before any callback can object), no timer is armed until a first
response is done, trailers are merged into the headers, and connections are accepted until the
process runs out of file descriptors. ``protocol_class(limits)`` returns a subclass that counts the
bytes fed to the parser, bounds the URL, head and fields, times the head, drops trailers and caps
the connections (shedding a lingering or the longest-idle one; the limits and the census of
connections are ``taogate.connection_limits``'s), answering in the error shape of the path's API
with ``connection: close`` (414, 431, 408, 400). A connection closed before its request's body is
all in lingers a moment, reading and discarding, so the client reads the answer instead of a reset.
Each request is served by ``taogate.cycle.Cycle`` (uvicorn's cycle, at less cost per request), from
the protocol's own per-request callbacks; the keep-alive timer is armed once per idle stretch, not
once per response. The connection's life (accepting, flow control, graceful shutdown) stays
uvicorn's; the uvicorn internals this relies on are pinned by ``tests/unit/test_listener.py``.
"""

from __future__ import annotations

import asyncio
import contextvars
import math
import urllib.parse
from collections import deque
from typing import Any, ClassVar, cast

import httptools
from mypy_extensions import mypyc_attr
from uvicorn.protocols.http.flow_control import service_unavailable
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from taogate.connection_limits import ConnectionCensus, ListenerLimits, Reject, field_refused, too_large
from taogate.cycle import METHODS, ASGIApp, Cycle, request_target

__all__ = ["LimitedProtocol", "protocol_class"]

#: A connection closed before its request was all in is still read (and discarded) while the
#: client sends, for up to ``_LINGER_S`` in all and ``_LINGER_IDLE_S`` between reads (nginx's
#: lingering close), so the client reads the answer instead of a reset; after a refused head, only
#: up to ``_LINGER_BYTES``.
_LINGER_S = 30.0
_LINGER_IDLE_S = 5.0
_LINGER_BYTES = 256 * 1024
#: Requests a connection may send ahead of their answers (HTTP/1.1 pipelining). Reading stops
#: while any wait, but one read may hold thousands of small heads: past this many waiting, the
#: connection is closed, as a client that sends without reading costs memory for each.
_MAX_PIPELINED = 32


@mypyc_attr(allow_interpreted_subclasses=True)
class LimitedProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the limits of ``_census`` (see the module docstring)."""

    _census: ClassVar[ConnectionCensus]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.cycle: Cycle | None = None  # type: ignore[assignment]
        self._serving: Cycle | None = None  # the one running, older than ``cycle`` when pipelined
        self.write_stall = self._census.limits.write_stall
        self.pipeline: deque[tuple[Cycle, ASGIApp]] = deque()  # type: ignore[assignment]
        self._asgi = {"version": self.asgi_version, "spec_version": "2.3"}
        self._fresh_context = self.config.reset_contextvars
        self._idle_since: float | None = None  # when the last response ended, if nothing came since
        self._limits = self._census.limits
        self._head_started = False  # a request's head has begun and not ended
        self._progress = False  # the parser got past a head, a body piece or a message this read
        self._stalled = 0  # bytes fed since the parser last made progress
        self._url_parts: list[bytes] = []
        self._url_len = 0
        self._head_size = 0
        self._head_budget = self._limits.max_header_bytes  # for the fields: the head's, less the URL
        self._saw_bytes = False
        self._timer: asyncio.TimerHandle | None = None
        self._rejected = False  # answered for good: what still arrives is discarded
        self._discarded = 0
        self._linger_bytes = 0.0
        self._linger_end = self._last_read = 0.0
        self._body_done = True  # the current request's message has ended
        self._keep_alive: float = cast(Any, self).timeout_keep_alive  # typed int by uvicorn, may be a float
        self._unsent = 0  # bytes of the last answer the client had not taken at the last look

    # -- the connection ------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        census = self._census
        if len(self.connections) > self._limits.max_connections and not census.shed(self):
            census.warn(
                "refused",
                f"client connection refused: {self._limits.max_connections} connections are open "
                "and none is idle ([gateway] max_client_connections)",
            )
            transport.abort()
            return
        census.idle[self] = None
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        # uvicorn's own, with this class's timers and pools, and the cycle told.
        self._cancel()
        self._census.idle.pop(self, None)
        self._census.lingering.pop(self, None)
        self.connections.discard(self)
        self.pipeline.clear()  # queued cycles hold this protocol
        for cycle in {self._serving, self.cycle}:  # a pipelined one's client is gone too
            if cycle is not None:
                cycle.on_lost()
        if self.flow is not None:
            self.flow.resume_writing()
        if exc is None:
            self.transport.close()
            self._unset_keepalive_if_required()
        self.parser = None  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        # uvicorn's own, with the byte count and the rejections of this class.
        if self._rejected:  # lingering: discarded, up to a point
            self._discarded += len(data)
            self._last_read = self.loop.time()
            if self._discarded > self._linger_bytes:
                self.transport.abort()
            return
        idle = self._idle_since
        self._idle_since = None  # the keep-alive timer, if armed, lets the connection be
        self._saw_bytes = True
        self._progress = False
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserCallbackError as exc:
            cause = exc.__context__
            if isinstance(cause, Reject):
                self._reject(cause)
            else:
                self._reject(Reject(400, "invalid_http_request", "Invalid HTTP request received."))
            return
        except httptools.HttpParserError:
            self._reject(Reject(400, "invalid_http_request", "Invalid HTTP request received."))
            return
        except httptools.HttpParserUpgrade:
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()
            return
        if self._head_started:
            if self._timer is None:
                self._arm()  # a head left unfinished by this read, on a kept-alive connection
        elif idle is not None and (self.cycle is None or self.cycle.response_complete):
            self._still_idle(idle)  # bytes that begin no request: a stray line end, a body's rest
        if self._progress:
            self._stalled = 0
            return
        # No head, body piece or message end in this read: a head (or a trailer section, or a
        # chunk-size line) that does not end. Stops httptools' quadratic accumulation early.
        self._stalled += len(data)
        if self._stalled > self._limits.max_header_bytes:
            self._reject(too_large(self._limits))

    # -- parser callbacks ----------------------------------------------------------------------
    def on_message_begin(self) -> None:
        self._head_started = True
        self.expect_100_continue = False
        self.headers = []
        self._url_parts = []
        self._url_len = self._head_size = 0
        self._head_budget = self._limits.max_header_bytes

    def on_url(self, url: bytes) -> None:
        # Called per fragment; uvicorn's `self.url += url` would copy the URL so far each time.
        self._url_len += len(url)
        self._url_parts.append(url)  # a refusal's error shape is the path's
        limits = self._limits
        if self._url_len > limits.max_url_bytes:
            raise Reject(414, "uri_too_long", f"The request target exceeds {limits.max_url_bytes} bytes.")
        self._head_budget = limits.max_header_bytes - self._url_len

    def on_header(self, name: bytes, value: bytes) -> None:
        if not self._head_started:
            return  # a trailer field: never merged into the request's headers
        self._head_size = size = self._head_size + len(name) + len(value) + 4
        headers = self.headers
        if size > self._head_budget or len(headers) >= self._limits.max_headers:
            raise field_refused(self._limits, len(headers))
        name = name.lower()
        if name == b"expect" and value.lower() == b"100-continue":
            self.expect_100_continue = True
        headers.append((name, value))

    def on_headers_complete(self) -> None:
        parts = self._url_parts
        self.url = url = parts[0] if len(parts) == 1 else b"".join(parts)
        self._head_started = self._body_done = False
        self._progress = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._census.idle.pop(self, None)
        parser = self.parser
        http_version = parser.get_http_version()
        method = parser.get_method()
        scope: dict[str, Any] = {
            "type": "http",
            "asgi": self._asgi,
            "http_version": http_version,
            "server": self.server,
            "client": self.client,
            "scheme": self.scheme,
            "root_path": self.root_path,
            "headers": self.headers,
            "state": self.app_state.copy(),
            "method": METHODS.get(method) or method.decode("ascii"),
        }
        self.scope = scope  # type: ignore[assignment]
        if parser.should_upgrade():
            if self._should_upgrade():
                return
            if _has_body(self.headers):  # httptools would take the body for the new protocol's
                raise Reject(
                    400,
                    "upgrade_with_body",
                    "This server does not switch protocols, and a request asking to may carry no "
                    "body here: send it without the Upgrade header.",
                )
        if url[:1] == b"/" and b"#" not in url:  # origin-form: request_target's fast way
            raw_path, _, query = url.partition(b"?")
        else:
            raw_path, query = request_target(url)
        path = raw_path.decode("ascii")
        if "%" in path:
            path = urllib.parse.unquote(path)
        if root := self.root_path:
            path, raw_path = root + path, root.encode("ascii") + raw_path
        scope["path"], scope["raw_path"], scope["query_string"] = path, raw_path, query
        app: ASGIApp = self.app
        if self.limit_concurrency is not None and (
            len(self.connections) >= self.limit_concurrency or len(self.tasks) >= self.limit_concurrency
        ):
            app = service_unavailable
            self.logger.warning("Exceeded concurrency limit.")
        existing = self.cycle
        keep_alive = http_version != "1.0" and parser.should_keep_alive()
        self.cycle = cycle = Cycle(self, scope, keep_alive, self.expect_100_continue)
        if existing is None or existing.response_complete:
            self._run(cycle, app)
        else:  # pipelined: served once the one before has answered
            if len(self.pipeline) >= _MAX_PIPELINED:
                raise Reject(
                    400,
                    "too_many_pipelined",
                    f"Over {_MAX_PIPELINED} requests were sent ahead of their answers.",
                )
            self.flow.pause_reading()
            self.pipeline.appendleft((cycle, app))

    def _run(self, cycle: Cycle, app: ASGIApp) -> None:
        """A task per request (a pipelined one waits its turn); in ``tasks`` until it is done, so
        uvicorn's graceful shutdown waits for it."""
        self._serving = cycle
        if self._fresh_context:  # uvicorn's opt-in: no context leaks from the lifespan
            task = self.loop.create_task(cycle.run(app, self.tasks), context=contextvars.Context())
        else:
            task = self.loop.create_task(cycle.run(app, self.tasks))
        self.tasks.add(task)

    def on_body(self, body: bytes) -> None:
        self._progress = True
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            cycle.on_body(body)

    def on_chunk_complete(self) -> None:
        self._progress = True

    def on_message_complete(self) -> None:
        self._progress = self._body_done = True
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            cycle.on_end()

    def on_response_complete(self) -> None:
        """The cycle's response is all written: the next pipelined request, else an idle wait."""
        self.server_state.total_requests += 1
        if self.transport.is_closing():
            return
        if self.pipeline:  # reading resumes once none waits (or a body needs reading)
            cycle, app = self.pipeline.pop()
            self._run(cycle, app)
            if not self.pipeline and self.flow.read_paused:
                self.flow.resume_reading()
            return
        if self.flow.read_paused:
            self.flow.resume_reading()
        self._idle_since = now = self.loop.time()
        self._unsent = 0
        if self.timeout_keep_alive_task is None:
            due = now + self._keep_alive
            self.timeout_keep_alive_task = self.loop.call_at(due, self._keep_alive_due)
        if not self._rejected:
            idle = self._census.idle
            idle.pop(self, None)
            idle[self] = None  # the most recently idle, last

    def _keep_alive_due(self) -> None:
        """uvicorn's keep-alive timeout, armed once per idle stretch instead of once per response:
        a byte from the client ends the stretch (the timer then lets go), a response starts one.
        A connection whose last answer the client is still reading is not idle until it is read;
        one whose client took none of it for ``write_stall`` is aborted (a close would wait)."""
        self.timeout_keep_alive_task = None
        since = self._idle_since
        if since is None:
            return
        due = since + self._keep_alive
        if self.loop.time() < due:
            self.timeout_keep_alive_task = self.loop.call_at(due, self._keep_alive_due)
            return
        unsent = self.transport.get_write_buffer_size()
        if not unsent:
            self.timeout_keep_alive_handler()
        elif unsent == self._unsent:  # nothing taken in a whole write stall: a close would wait for ever
            self.transport.abort()
        else:  # the last answer is still being read: not idle yet; looked at again a stall later
            self._unsent = unsent
            again = self.write_stall or self._keep_alive
            self.timeout_keep_alive_task = self.loop.call_later(again, self._keep_alive_due)

    def _still_idle(self, since: float) -> None:
        """The keep-alive wait that began at ``since`` goes on (its timer armed again if it let go)."""
        self._idle_since = since
        if self.timeout_keep_alive_task is None:
            self.timeout_keep_alive_task = self.loop.call_at(since + self._keep_alive, self._keep_alive_due)

    def _unsupported_upgrade_warning(self) -> None:
        self._census.warn("upgrade", "a client asked to upgrade the connection; it stays HTTP/1.1")

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
            Reject(
                408,
                "header_timeout",
                f"The request head was not received within {self._limits.header_timeout:g}s.",
            )
        )

    def _reject(self, rejection: Reject) -> None:
        """Answer (unless a request of the connection is still being served: then only close),
        read and discard what the client still sends for a moment, then close."""
        self._cancel()
        self._rejected = True
        self._census.warn(rejection.code, f"client request refused: {rejection.message}")
        transport = self.transport
        if self.cycle is not None and not self.cycle.response_complete:
            transport.close()
            return
        target = b"".join(self._url_parts).partition(b"?")[0]  # this request's, or the last one's
        shape = self._limits.errors_at(target.decode("latin-1"))
        body = shape.refusal(rejection.status, rejection.code, rejection.message)
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

    def close_after_response(self) -> None:
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
        self._census.idle.pop(self, None)
        self._census.lingering[self] = None

    def _lingered(self) -> None:
        due = min(self._linger_end, self._last_read + _LINGER_IDLE_S)
        if self.loop.time() >= due:
            self._timer = None
            self.transport.abort()
        else:
            self._timer = self.loop.call_at(due, self._lingered)


def _has_body(headers: list[tuple[bytes, bytes]]) -> bool:
    """Whether a request head announces a body (a length above 0, or a transfer coding)."""
    for name, value in headers:
        if name == b"transfer-encoding" or (name == b"content-length" and value.strip(b" \t0")):
            return True
    return False


def protocol_class(limits: ListenerLimits) -> type[LimitedProtocol]:
    """A protocol class for one server (its connections share the cap and the idle order)."""
    return cast(
        type[LimitedProtocol],
        type("LimitedProtocol", (LimitedProtocol,), {"_census": ConnectionCensus(limits)}),
    )
