"""The uvicorn and httptools internals ``taogate.listener`` and ``taogate.h1`` rely on: an upgrade
that moves one fails here, by name, before it fails a request. (``taogate.cycle`` is held to
uvicorn's own cycle in ``test_cycle.py``.)"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import re
import socket
from typing import Any

import httptools
import pytest
import uvicorn
from hypothesis import given, settings
from hypothesis import strategies as st
from uvicorn.protocols.http import httptools_impl
from uvicorn.protocols.http.flow_control import HIGH_WATER_LIMIT, FlowControl, service_unavailable
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from taogate.connection_limits import ListenerLimits
from taogate.cycle import request_target
from taogate.gateway_settings import GatewaySettings
from taogate.listener import LimitedProtocol, protocol_class
from taogate.serving import gateway_server_options, serve_asgi

#: Methods of uvicorn's protocol the subclass inherits and calls (the per-request ones are its own).
USED_METHODS = (
    "connection_made",
    "shutdown",
    "pause_writing",
    "resume_writing",
    "timeout_keep_alive_handler",
    "_unset_keepalive_if_required",
    "_should_upgrade",
    "handle_websocket_upgrade",
    "_unsupported_upgrade_warning",
)
#: Attributes uvicorn's protocol sets in ``__init__`` and ``connection_made`` that the subclass reads.
USED_ATTRIBUTES = (
    "config",
    "app",
    "app_state",
    "root_path",
    "asgi_version",
    "limit_concurrency",
    "logger",
    "connections",
    "tasks",
    "pipeline",
    "cycle",
    "server_state",
    "loop",
    "flow",
    "transport",
    "parser",
    "server",
    "client",
    "scheme",
    "timeout_keep_alive",
    "timeout_keep_alive_task",
)


def _source(obj: Any) -> str:
    return inspect.getsource(obj)


def test_the_protocol_methods_the_subclass_relies_on_exist() -> None:
    missing = [name for name in USED_METHODS if not callable(getattr(HttpToolsProtocol, name, None))]
    assert missing == []


def test_the_protocol_attributes_the_subclass_reads_are_set_where_it_expects() -> None:
    init = _source(HttpToolsProtocol.__init__) + _source(HttpToolsProtocol.connection_made)
    assert [a for a in USED_ATTRIBUTES if f"self.{a} = " not in init and f"self.{a}: " not in init] == []
    assert "STATUS_LINE" in vars(httptools_impl)
    assert "reset_contextvars" in _source(uvicorn.Config.__init__)


def test_uvicorns_shutdown_asks_only_what_a_cycle_has() -> None:
    # The server calls shutdown() on each connection, then waits for server_state's tasks.
    src = _source(HttpToolsProtocol.shutdown)
    assert "self.cycle.response_complete" in src and "self.cycle.keep_alive = False" in src
    assert set(re.findall(r"self\.cycle\.(\w+)", src)) <= {"response_complete", "keep_alive"}
    server = _source(uvicorn.Server.shutdown) + _source(uvicorn.Server._wait_tasks_to_complete)
    assert "connection.shutdown()" in server and "self.server_state.tasks" in server


def test_the_keepalive_timer_is_the_one_uvicorn_cancels_and_its_handler_closes() -> None:
    assert "self.timeout_keep_alive_task.cancel()" in _source(HttpToolsProtocol._unset_keepalive_if_required)
    assert "self.transport.close()" in _source(HttpToolsProtocol.timeout_keep_alive_handler)


def test_the_flow_control_the_cycle_uses() -> None:
    flow = _source(FlowControl)
    used = ("def drain", "def pause_reading", "def resume_reading", "self.read_paused", "self.write_paused")
    assert [name for name in used if name not in flow] == []
    assert callable(service_unavailable) and HIGH_WATER_LIMIT > 0


def test_uvicorn_accepts_a_protocol_class_for_http() -> None:
    cls = protocol_class(ListenerLimits())
    config = uvicorn.Config(lambda *_: None, http=cls, ws="none")
    config.load()
    assert config.http_protocol_class is cls
    assert config.ws_protocol_class is None


_TARGET = st.text(alphabet=st.sampled_from("/?#%=&.-_~+;:@!$'()*,aZ09"), max_size=12)


@settings(max_examples=400, deadline=None)
@given(_TARGET, st.booleans())
def test_a_request_target_splits_as_httptools_parses_it(target: str, absolute: bool) -> None:
    url = (("http://h" if absolute else "") + "/" + target).encode()
    try:
        parsed = httptools.parse_url(url)
    except httptools.HttpParserInvalidURLError:
        return
    assert request_target(url) == (parsed.path, parsed.query or b"")


class _Recorder:
    def __init__(self, fail_on_header: bool = False) -> None:
        self.urls: list[bytes] = []
        self.headers: list[tuple[bytes, bytes]] = []
        self.fail = fail_on_header

    def on_url(self, url: bytes) -> None:
        self.urls.append(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        if self.fail:
            raise LookupError("refused")
        self.headers.append((name, value))


def test_httptools_calls_on_url_per_fragment() -> None:
    rec = _Recorder()
    parser = httptools.HttpRequestParser(rec)
    parser.feed_data(b"GET /ab")
    parser.feed_data(b"cd HTTP/1.1\r\nhost: x\r\n\r\n")
    assert rec.urls == [b"/ab", b"cd"]


def test_an_exception_in_a_callback_comes_out_as_a_callback_error_with_it_as_context() -> None:
    parser = httptools.HttpRequestParser(_Recorder(fail_on_header=True))
    with pytest.raises(httptools.HttpParserCallbackError) as caught:
        parser.feed_data(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
    assert isinstance(caught.value.__context__, LookupError)


def test_trailers_come_through_on_header_after_the_head() -> None:
    rec = _Recorder()
    parser = httptools.HttpRequestParser(rec)
    parser.feed_data(b"POST / HTTP/1.1\r\ntransfer-encoding: chunked\r\n\r\n2\r\nok\r\n0\r\nx-t: 1\r\n\r\n")
    assert rec.headers[-1] == (b"x-t", b"1")


def test_an_upgrade_is_not_a_parser_error() -> None:
    # h1 catches it by name: an ``except HttpParserError`` alone would let it out of data_received.
    assert not issubclass(httptools.HttpParserUpgrade, httptools.HttpParserError)
    parser = httptools.HttpResponseParser(_Recorder())
    with pytest.raises(httptools.HttpParserUpgrade):
        parser.feed_data(b"HTTP/1.1 101 Switching Protocols\r\nupgrade: x\r\nconnection: upgrade\r\n\r\n")


def test_the_gateway_is_served_with_the_limited_protocol_and_its_limits() -> None:
    cfg = GatewaySettings(
        max_headers=20, header_timeout=3.0, keepalive_timeout=9.0, max_client_connections=100
    )
    options = gateway_server_options(cfg, upstream=64)
    cls = options["http"]
    assert issubclass(cls, LimitedProtocol)
    limits = cls._census.limits
    assert (limits.max_headers, limits.header_timeout, limits.max_connections) == (20, 3.0, 100)
    assert options["timeout_keep_alive"] == 9.0 and options["ws"] == "none"
    assert protocol_class(limits)._census is not cls._census  # one server, one set of connections


async def _app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


async def _ask(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bytes:
    writer.write(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
    return await reader.readuntil(b"\r\n\r\nok")


async def test_keep_alive_closes_a_connection_idle_for_its_timeout_and_spares_a_busy_one() -> None:
    options = {"http": protocol_class(ListenerLimits()), "ws": "none", "timeout_keep_alive": 0.4}
    async with serve_asgi(_app, **options) as served:
        reader, writer = await asyncio.open_connection("127.0.0.1", served.port)
        busy_reader, busy_writer = await asyncio.open_connection("127.0.0.1", served.port)
        await _ask(reader, writer)
        await asyncio.sleep(0)
        assert served.server.server_state.tasks == set()  # a request's task leaves when done
        for _ in range(6):  # a request every 0.1 s: never idle for 0.4 s, across several timers
            await _ask(busy_reader, busy_writer)
            await asyncio.sleep(0.1)
        assert await asyncio.wait_for(reader.read(), 2.0) == b""  # closed, idle since the first answer
        await _ask(busy_reader, busy_writer)
        started = asyncio.get_running_loop().time()
        assert await asyncio.wait_for(busy_reader.read(), 2.0) == b""
        assert 0.3 < asyncio.get_running_loop().time() - started < 1.5
        writer.close()
        busy_writer.close()


_BIG = 16 << 20  # far more than the kernel's buffers hold: most of it waits in the gateway


async def _big(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    headers = [(b"content-length", str(_BIG).encode())]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": b"x" * _BIG})


def _open_ports(served: Any) -> set[int]:
    return {c.client[1] for c in served.server.server_state.connections}


async def test_an_answer_its_client_stopped_reading_is_dropped_and_one_being_read_is_not() -> None:
    """A whole answer goes to the transport at once; past the keep-alive timeout a close would wait
    for a client that reads nothing, the answer held in memory for ever: aborted after a write
    stall with nothing taken. A client still reading is not idle, however long it takes."""
    limits = ListenerLimits(write_stall=0.5)
    options = {"http": protocol_class(limits), "ws": "none", "timeout_keep_alive": 0.3}
    async with serve_asgi(_big, **options) as served:
        stalled = socket.socket()
        stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        stalled.connect(("127.0.0.1", served.port))
        stalled.sendall(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
        reader, writer = await asyncio.open_connection("127.0.0.1", served.port)
        writer.write(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
        mine, theirs = writer.get_extra_info("sockname")[1], stalled.getsockname()[1]
        taken = 0
        for _ in range(300):  # 16 KiB every 10 ms: the answer takes 10 s, the timers under 2
            taken += len(await asyncio.wait_for(reader.read(16384), 5.0))
            await asyncio.sleep(0.01)
            if theirs not in _open_ports(served):
                break
        assert _open_ports(served) == {mine} and taken < _BIG, taken  # dropped; still reading
        writer.close()
        stalled.close()


async def _echo(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    body = b""
    more = True
    while more:
        message = await receive()
        body += message.get("body", b"")
        more = message.get("more_body", False)
    answer = scope["method"].encode() + b" " + scope["raw_path"] + b"?" + scope["query_string"] + b" " + body
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    await send({"type": "http.response.body", "body": answer})


async def _exchange(port: int, request: bytes, *, until_close: bool = True) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request)
        if until_close:
            return await asyncio.wait_for(reader.read(), 5.0)
        await asyncio.sleep(0.3)
        return await asyncio.wait_for(reader.read(65536), 5.0)
    finally:
        writer.close()


async def test_pipelined_chunked_continued_head_and_http10_requests_are_answered_in_order() -> None:
    options = {"http": protocol_class(ListenerLimits()), "ws": "none", "server_header": False}
    async with serve_asgi(_echo, **options) as served:
        pipelined = (
            b"POST /a?x=1 HTTP/1.1\r\nhost: h\r\ncontent-length: 3\r\n\r\nabc"
            b"POST /b HTTP/1.1\r\nhost: h\r\ntransfer-encoding: chunked\r\n\r\n2\r\nde\r\n1\r\nf\r\n0\r\n\r\n"
            b"HEAD /c HTTP/1.1\r\nhost: h\r\n\r\n"
            b"GET /d HTTP/1.1\r\nhost: h\r\nconnection: close\r\n\r\n"
        )
        wire = await _exchange(served.port, pipelined)
        answers = wire.split(b"HTTP/1.1 200 OK\r\n")[1:]
        assert len(answers) == 4
        assert answers[0].endswith(b"\r\n\r\nf\r\nPOST /a?x=1 abc\r\n0\r\n\r\n")
        assert answers[1].endswith(b"\r\n\r\nc\r\nPOST /b? def\r\n0\r\n\r\n")
        assert answers[2].endswith(b"content-type: text/plain\r\n\r\n")  # HEAD: no body, no framing
        assert b"connection: close\r\n" in answers[3]
        assert answers[3].endswith(b"\r\n\r\n8\r\nGET /d? \r\n0\r\n\r\n")
        old = await _exchange(served.port, b"GET /e HTTP/1.0\r\n\r\n")
        assert b"connection: close\r\n" in old and old.endswith(b"\r\n\r\nGET /e? ")  # no chunks in 1.0
        assert b"transfer-encoding" not in old
        reader, writer = await asyncio.open_connection("127.0.0.1", served.port)
        writer.write(b"POST /f HTTP/1.1\r\nhost: h\r\nexpect: 100-continue\r\ncontent-length: 2\r\n\r\n")
        assert await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5.0) == b"HTTP/1.1 100 Continue\r\n\r\n"
        writer.write(b"gh")
        assert (await asyncio.wait_for(reader.readuntil(b"POST /f? gh"), 5.0)).startswith(b"HTTP/1.1 200 OK")
        writer.close()


async def test_a_client_pipelining_thousands_of_requests_is_cut_off_at_the_cap() -> None:
    """One write of 5,000 small requests: the first ones are answered in order, then the
    connection closes, instead of 5,000 requests held in memory while they wait their turn."""
    options = {"http": protocol_class(ListenerLimits()), "ws": "none", "server_header": False}
    async with serve_asgi(_echo, **options) as served:
        reader, writer = await asyncio.open_connection("127.0.0.1", served.port)
        writer.write(b"GET /p HTTP/1.1\r\nhost: h\r\n\r\n" * 5_000)
        wire = b""
        with contextlib.suppress(ConnectionResetError):  # closed with requests unread: a reset
            while piece := await asyncio.wait_for(reader.read(65536), 5.0):
                wire += piece
        writer.close()
        assert wire.count(b"HTTP/1.1 200 OK\r\n") <= 40  # it ended, well short of 5,000
        await asyncio.sleep(0.1)
        assert served.server.server_state.tasks == set()


async def test_a_client_gone_while_a_pipelined_request_waits_is_told_to_the_one_being_served() -> None:
    """The connection's newest cycle is the queued one: the one being served must hear of the
    disconnect too, or a stream for a client long gone runs to its end."""
    told: list[str] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        await receive()  # the (empty) body
        async with asyncio.timeout(5):
            told.append((await receive())["type"])  # what a disconnect watch waits for
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"0")]})
        await send({"type": "http.response.body", "body": b""})

    options = {"http": protocol_class(ListenerLimits()), "ws": "none", "server_header": False}
    async with serve_asgi(app, **options) as served:
        _, writer = await asyncio.open_connection("127.0.0.1", served.port)
        one = b"POST /a HTTP/1.1\r\nhost: h\r\ncontent-length: 0\r\n\r\n"
        writer.write(one + one.replace(b"/a", b"/b"))
        await writer.drain()
        await asyncio.sleep(0.2)
        writer.close()
        for _ in range(40):
            if told:
                break
            await asyncio.sleep(0.05)
    assert told == ["http.disconnect"]
