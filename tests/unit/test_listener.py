"""The uvicorn and httptools internals ``taogate.listener`` and ``taogate.h1`` rely on: an upgrade
that moves one fails here, by name, before it fails a request."""

from __future__ import annotations

import asyncio
import inspect
import re
from typing import Any, cast

import httptools
import pytest
import uvicorn
from uvicorn.protocols.http import httptools_impl
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

from taogate.listener import LimitedProtocol, ListenerLimits, _CycleTransport, protocol_class
from taogate.serving import gateway_server_options
from taogate.settings import GatewaySettings

#: Methods of uvicorn's protocol the subclass overrides or calls.
USED_METHODS = (
    "connection_made",
    "connection_lost",
    "data_received",
    "on_message_begin",
    "on_url",
    "on_header",
    "on_headers_complete",
    "on_body",
    "on_message_complete",
    "on_response_complete",
    "_unset_keepalive_if_required",
    "_should_upgrade",
    "handle_websocket_upgrade",
    "_unsupported_upgrade_warning",
)
#: Attributes uvicorn's protocol sets in ``__init__`` and ``connection_made`` that it reads.
USED_ATTRIBUTES = ("connections", "pipeline", "cycle", "server_state", "loop", "flow", "transport", "parser")


def _source(obj: Any) -> str:
    return inspect.getsource(obj)


def test_the_protocol_methods_the_subclass_relies_on_exist() -> None:
    missing = [name for name in USED_METHODS if not callable(getattr(HttpToolsProtocol, name, None))]
    assert missing == []


def test_the_protocol_attributes_the_subclass_reads_are_set_where_it_expects() -> None:
    init = _source(HttpToolsProtocol.__init__) + _source(HttpToolsProtocol.connection_made)
    assert [a for a in USED_ATTRIBUTES if f"self.{a} = " not in init and f"self.{a}: " not in init] == []
    assert "STATUS_LINE" in vars(httptools_impl)


def test_uvicorn_builds_the_url_in_on_url_and_parses_it_when_the_head_is_done() -> None:
    # The subclass collects the fragments itself and sets self.url before the head is complete.
    assert "self.url += url" in _source(HttpToolsProtocol.on_url)
    assert "httptools.parse_url(self.url)" in _source(HttpToolsProtocol.on_headers_complete)


def test_uvicorns_header_callback_is_what_the_subclass_writes_out() -> None:
    # LimitedProtocol.on_header does uvicorn's work itself, instead of a call per field.
    src = _source(HttpToolsProtocol.on_header)
    assert "name = name.lower()" in src
    assert 'name == b"expect" and value.lower() == b"100-continue"' in src
    assert "self.expect_100_continue = True" in src
    assert "self.headers.append((name, value))" in src


def test_a_cycle_takes_the_protocol_transport_and_its_response_callback_at_the_head() -> None:
    src = _source(HttpToolsProtocol.on_headers_complete)
    assert "transport=self.transport" in src
    assert "on_response=self.on_response_complete" in src


def test_a_cycle_only_writes_asks_and_closes_its_transport() -> None:
    used = set(re.findall(r"self\.transport\.(\w+)", _source(RequestResponseCycle)))
    assert used <= {"write", "close", "is_closing"}


def test_the_keepalive_timer_is_armed_after_a_response_and_cancelled_by_any_byte() -> None:
    assert "timeout_keep_alive_task = self.loop.call_later" in _source(HttpToolsProtocol.on_response_complete)
    assert "_unset_keepalive_if_required" in _source(HttpToolsProtocol.data_received)


def test_uvicorn_accepts_a_protocol_class_for_http() -> None:
    cls = protocol_class(ListenerLimits())
    config = uvicorn.Config(lambda *_: None, http=cls, ws="none")
    config.load()
    assert config.http_protocol_class is cls
    assert config.ws_protocol_class is None


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
    options = gateway_server_options(cfg)
    cls = options["http"]
    assert issubclass(cls, LimitedProtocol)
    limits = cls._listener.limits
    assert (limits.max_headers, limits.header_timeout, limits.max_connections) == (20, 3.0, 100)
    assert options["timeout_keep_alive"] == 9.0 and options["ws"] == "none"
    assert protocol_class(limits)._listener is not cls._listener  # one server, one set of connections


class _Wire:
    """A transport that records what is written to it."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        assert not self.closed, "written after it closed"
        self.writes.append(data)

    def is_closing(self) -> bool:
        return self.closed


class _Connection:
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.transport = _Wire()
        self.loop = loop
        self.closed = False

    def _close_after_response(self) -> None:
        self.closed = True


async def test_a_response_head_goes_out_with_its_body_in_one_write() -> None:
    conn = _Connection(asyncio.get_running_loop())
    cycle = _CycleTransport(cast(LimitedProtocol, conn))
    cycle.write(b"HTTP/1.1 200 OK\r\n\r\n")
    assert conn.transport.writes == []
    cycle.write(b"body")
    cycle.write(b"more")
    assert conn.transport.writes == [b"HTTP/1.1 200 OK\r\n\r\nbody", b"more"]
    await asyncio.sleep(0)
    assert conn.transport.writes == [b"HTTP/1.1 200 OK\r\n\r\nbody", b"more"]


async def test_a_head_without_a_body_yet_goes_out_at_the_end_of_the_loop_turn_or_at_close() -> None:
    loop = asyncio.get_running_loop()
    stream = _Connection(loop)
    _CycleTransport(cast(LimitedProtocol, stream)).write(b"head")
    await asyncio.sleep(0)
    assert stream.transport.writes == [b"head"]
    closing = _Connection(loop)
    cycle = _CycleTransport(cast(LimitedProtocol, closing))
    cycle.write(b"head")
    cycle.close()
    assert closing.transport.writes == [b"head"] and closing.closed
    gone = _Connection(loop)
    _CycleTransport(cast(LimitedProtocol, gone)).write(b"head")
    gone.transport.closed = True  # the client went away within the loop turn
    await asyncio.sleep(0)
    assert gone.transport.writes == []
    big = _Connection(loop)
    cycle = _CycleTransport(cast(LimitedProtocol, big))
    cycle.write(b"head")
    cycle.write(b"x" * 70000)
    assert [len(w) for w in big.transport.writes] == [4, 70000]
