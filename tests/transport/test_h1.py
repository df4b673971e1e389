"""h1.Pool against real sockets on 127.0.0.1: scripted servers that misbehave on purpose (each
test runs on both event loops, see conftest.py)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from taogate import h1

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
OK = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}"


class Script:
    """A loopback server whose connections run ``handler``; counts connections and requests."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections = 0
        self.closed_by_client = asyncio.Event()
        self.server: asyncio.Server | None = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            await self.handler(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        except asyncio.CancelledError:  # the server closes under a waiting handler: its end, not an error
            return
        finally:
            writer.close()

    @property
    def origin(self) -> h1.Origin:
        assert self.server is not None
        port = self.server.sockets[0].getsockname()[1]
        return h1.Origin.parse(f"http://127.0.0.1:{port}")


@contextlib.asynccontextmanager
async def script(handler: Handler) -> AsyncIterator[Script]:
    s = Script(handler)
    s.server = await asyncio.start_server(s._serve, "127.0.0.1", 0)
    try:
        yield s
    finally:
        s.server.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(s.server.wait_closed(), 2)


async def read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":")[1])
    return head + await reader.readexactly(length)


def pool(**kw: Any) -> h1.Pool:
    args: dict[str, Any] = {"connect_timeout": 2.0, "read_timeout": 5.0, "pool_timeout": 5.0}
    return h1.Pool(kw.pop("limit", 8), **{**args, **kw})


async def keep_alive(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while True:
        await read_request(reader)
        writer.write(OK)
        await writer.drain()


async def test_origin_parse() -> None:
    o = h1.Origin.parse("http://user:p%40ss@10.0.0.1:8000/prefix/")
    assert (o.host, o.port, o.path, o.authority) == ("10.0.0.1", 8000, b"/prefix", b"10.0.0.1:8000")
    assert o.basic_auth == b"Basic dXNlcjpwQHNz"  # user:p@ss
    assert h1.Origin.parse("https://api.example.com").port == 443
    assert h1.Origin.parse("https://api.example.com").authority == b"api.example.com"
    assert h1.Origin.parse("http://[::1]:9/").authority == b"[::1]:9"
    with pytest.raises(ValueError):
        h1.Origin.parse("ftp://x")


async def test_request_head_and_keep_alive_reuse() -> None:
    seen: list[bytes] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            seen.append(await read_request(reader))
            writer.write(OK)

    async with script(handler) as s:
        p = pool()
        for _ in range(3):
            r = await p.request(s.origin, b"/v1/x", [(b"x-a", b"1")], b'{"k":1}')
            got = (r.status_code, await r.aread(), r.header("Content-Type"))
            assert got == (200, b"{}", "application/json")
        assert s.connections == 1 and p.open_connections == 1 and p.idle_connections == 1
        head = seen[0].decode()
        assert head.startswith("POST /v1/x HTTP/1.1\r\nhost: 127.0.0.1:")
        assert "x-a: 1\r\n" in head and "content-length: 7\r\n" in head and head.endswith('{"k":1}')
        await p.aclose()
        assert p.open_connections == 0


async def test_chunked_body_arrives_as_it_is_sent() -> None:
    release = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n")
        writer.write(b"transfer-encoding: chunked\r\n\r\n")
        writer.write(b"7\r\ndata: 1\r\n")
        await writer.drain()
        await release.wait()
        writer.write(b"7\r\ndata: 2\r\n0\r\n\r\n")
        await read_request(reader)  # the connection is reused for a second request
        writer.write(OK)

    async with script(handler) as s:
        p = pool()
        r = await p.request(s.origin, b"/", [], b"")
        chunks = r.aiter_raw()
        assert await anext(chunks) == b"data: 1"  # before the server sends the rest
        release.set()
        assert [c async for c in chunks] == [b"data: 2"]
        r.close()
        r2 = await p.request(s.origin, b"/", [], b"")
        assert await r2.aread() == b"{}" and s.connections == 1
        await p.aclose()


async def test_closing_an_unfinished_response_aborts_the_connection() -> None:
    gone = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n1\r\na\r\n")
        await writer.drain()
        assert await reader.read(1) == b""  # what vLLM sees: the client went away
        gone.set()

    async with script(handler) as s:
        p = pool()
        r = await p.request(s.origin, b"/", [], b"")
        r.close()
        await asyncio.wait_for(gone.wait(), 5)
        assert p.open_connections == 0
        await p.aclose()


async def test_read_timeouts_before_headers_and_mid_body() -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        await asyncio.sleep(10)

    async def stalls(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n1\r\na\r\n")
        await asyncio.sleep(10)

    for handler in (silent, stalls):
        async with script(handler) as s:
            p = pool(read_timeout=0.2)
            with pytest.raises(h1.ReadTimeout):
                r = await p.request(s.origin, b"/", [], b"")
                await r.aread()
            assert p.open_connections == 0
            await p.aclose()


async def test_a_reused_connection_times_out_on_its_own_silence_and_a_lowered_timeout_holds() -> None:
    """The read timer armed for one reply stays for the next on the same connection: the next
    reply's silence is still timed from when it began, and a timeout lowered meanwhile (a reload)
    still applies."""
    answered = 0

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal answered
        while True:
            await read_request(reader)
            if answered >= 2:
                await asyncio.sleep(10)  # the third request on this connection hangs
            answered += 1
            writer.write(OK)

    async with script(handler) as s:
        loop = asyncio.get_running_loop()
        p = pool(read_timeout=0.3)
        assert await (await p.request(s.origin, b"/", [], b"")).aread() == b"{}"
        await asyncio.sleep(0.2)  # most of the first timer's span passes while idle
        assert await (await p.request(s.origin, b"/", [], b"")).aread() == b"{}"
        started = loop.time()
        with pytest.raises(h1.ReadTimeout):
            await p.request(s.origin, b"/", [], b"")
        assert 0.25 <= loop.time() - started < 1.0  # timed from its own start, not the first reply's
        assert s.connections == 1
        await p.aclose()

    async with script(handler) as s:
        answered = 0
        p = pool(read_timeout=30.0)
        assert await (await p.request(s.origin, b"/", [], b"")).aread() == b"{}"
        p.limits = dataclasses.replace(p.limits, read_timeout=0.2)  # reloaded
        assert await (await p.request(s.origin, b"/", [], b"")).aread() == b"{}"
        started = loop.time()
        with pytest.raises(h1.ReadTimeout):
            await p.request(s.origin, b"/", [], b"")
        assert loop.time() - started < 1.0
        await p.aclose()


async def test_a_slow_consumer_is_not_a_silent_server() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 3\r\n\r\nabc")

    async with script(handler) as s:
        p = pool(read_timeout=0.1)
        r = await p.request(s.origin, b"/", [], b"")
        await asyncio.sleep(0.3)  # longer than the read timeout, but nobody was waiting for data
        assert await r.aread() == b"abc"
        await p.aclose()


async def test_connect_refused_and_closed_mid_body() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    p = pool()
    with pytest.raises(h1.ConnectError):
        await p.request(h1.Origin.parse(f"http://127.0.0.1:{port}"), b"/", [], b"")
    assert p.open_connections == 0

    async def breaks(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\npartial")
        await writer.drain()

    async with script(breaks) as s:
        r = await p.request(s.origin, b"/", [], b"")
        with pytest.raises(h1.RemoteProtocolError):
            await r.aread()
        r.close()
    assert p.open_connections == 0
    await p.aclose()


async def test_malformed_reply_and_body_until_close() -> None:
    async def garbage(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"NOT HTTP AT ALL\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(1)

    async def until_close(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\nall of it")
        await writer.drain()

    p = pool()
    async with script(garbage) as s:
        with pytest.raises(h1.RemoteProtocolError, match="malformed"):
            await p.request(s.origin, b"/", [], b"")
    async with script(until_close) as s:
        r = await p.request(s.origin, b"/", [], b"")
        assert await r.aread() == b"all of it"
    assert p.open_connections == 0
    await p.aclose()


async def test_interim_replies_are_skipped_and_an_extra_reply_poisons_the_connection() -> None:
    async def interim(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nlink: </a>\r\n\r\n" + OK)
        await read_request(reader)
        writer.write(OK + OK)  # two replies to one request
        await asyncio.sleep(1)

    async with script(interim) as s:
        p = pool()
        r = await p.request(s.origin, b"/", [], b"")
        assert (r.status_code, await r.aread(), r.header("link")) == (200, b"{}", "")
        r = await p.request(s.origin, b"/", [], b"")
        assert await r.aread() == b"{}"
        assert (s.connections, p.open_connections) == (1, 0)  # not put back: its framing is off
        await p.aclose()


async def test_idle_connection_closed_by_the_server_is_replaced_transparently() -> None:
    async def one_per_connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(OK)  # keep-alive advertised, then closed: the idle race, every time
        await writer.drain()

    async with script(one_per_connection) as s:
        p = pool()
        for _ in range(3):
            r = await p.request(s.origin, b"/", [], b"")
            assert await r.aread() == b"{}"
            await asyncio.sleep(0.05)
        assert s.connections == 3
        await p.aclose()


async def test_a_request_that_lost_the_idle_race_is_sent_again_on_a_fresh_connection() -> None:
    """Two idle connections the server drops as the next request arrives (the keep-alive race):
    the request that lost it on one is sent again on a new connection, not on the other idle one."""

    async def then_drop(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(OK)
        await writer.drain()
        await read_request(reader)  # the next request on this connection: dropped unanswered
        writer.close()

    async with script(then_drop) as s:
        p = pool()
        first = await asyncio.gather(*(p.request(s.origin, b"/", [], b"") for _ in range(2)))
        for r in first:
            assert await r.aread() == b"{}"
        assert p.idle_connections == 2
        r = await p.request(s.origin, b"/", [], b"")
        assert await r.aread() == b"{}"
        assert s.connections == 3
        await p.aclose()


async def test_waiters_woken_by_close_open_no_connection() -> None:
    async with script(keep_alive) as s:
        p = pool(limit=1)
        held = await p.request(s.origin, b"/", [], b"")
        waiter = asyncio.create_task(p.request(s.origin, b"/", [], b""))
        await asyncio.sleep(0.02)
        await p.aclose()
        with pytest.raises(h1.ConnectError, match="closed"):
            await waiter
        assert s.connections == 1
        held.close()


async def test_idle_connections_expire_after_keepalive() -> None:
    async with script(keep_alive) as s:
        p = pool(keepalive=0.05)
        await (await p.request(s.origin, b"/", [], b"")).aread()
        await asyncio.sleep(0.1)
        await (await p.request(s.origin, b"/", [], b"")).aread()
        assert s.connections == 2 and p.open_connections == 1
        await p.aclose()


async def test_pool_limit_waits_hands_over_and_times_out_without_leaking() -> None:
    async with script(keep_alive) as s:
        p = pool(limit=1, pool_timeout=0.2)
        first = await p.request(s.origin, b"/", [], b"")
        second = asyncio.create_task(p.request(s.origin, b"/", [], b""))
        await asyncio.sleep(0.02)
        assert not second.done()
        assert await first.aread() == b"{}"  # read to its end: handed to the waiter
        assert await (await second).aread() == b"{}"
        assert s.connections == 1

        held = await p.request(s.origin, b"/", [], b"")
        with pytest.raises(h1.PoolTimeout, match="no free connection"):
            await p.request(s.origin, b"/", [], b"")
        waiter = asyncio.create_task(p.request(s.origin, b"/", [], b""))
        await asyncio.sleep(0.02)
        waiter.cancel()  # a client that hangs up while waiting for a connection
        with pytest.raises(asyncio.CancelledError):
            await waiter
        await held.aread()
        assert (p.open_connections, p.idle_connections) == (1, 1)
        r = await p.request(s.origin, b"/", [], b"")
        assert await r.aread() == b"{}"
        await p.aclose()


async def test_at_the_limit_an_idle_connection_to_another_origin_makes_room() -> None:
    async with script(keep_alive) as a, script(keep_alive) as b:
        p = pool(limit=1)
        await (await p.request(a.origin, b"/", [], b"")).aread()
        await (await p.request(b.origin, b"/", [], b"")).aread()
        assert (a.connections, b.connections, p.open_connections) == (1, 1, 1)
        await p.aclose()


async def test_without_a_limit_every_request_gets_a_connection_and_the_idle_ones_stay_per_origin() -> None:
    async with script(keep_alive) as a, script(keep_alive) as b:
        p = pool(limit=None, pool_timeout=0.2)
        held = [await p.request(o, b"/", [], b"") for o in (a.origin, b.origin) for _ in range(3)]
        assert (a.connections, b.connections, p.open_connections) == (3, 3, 6)
        for r in held:
            assert await r.aread() == b"{}"
        assert p.idle_connections == 6  # none closed to make room for another origin
        await (await p.request(b.origin, b"/", [], b"")).aread()
        assert (b.connections, p.open_connections) == (3, 6)
        await p.aclose()


async def test_flow_control_pauses_reading_for_a_slow_consumer() -> None:
    size = 2 * 1024 * 1024

    async def big(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % size)
        writer.write(b"x" * size)
        await writer.drain()

    async with script(big) as s:
        p = pool()
        r = await p.request(s.origin, b"/", [], b"")
        await asyncio.sleep(0.2)
        assert r._buffered < size  # reading paused instead of buffering the whole body
        assert len(await r.aread()) == size
        await p.aclose()


async def test_header_names_come_in_lower_case_once() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nX-Mixed-Case: A\r\n")
        writer.write(b"Content-Length: 2\r\n\r\n{}")

    async with script(handler) as s:
        p = pool()
        r = await p.request(s.origin, b"/", [], b"")
        assert r.raw_headers == [
            (b"content-type", b"application/json"),
            (b"x-mixed-case", b"A"),
            (b"content-length", b"2"),
        ]
        assert r.header("X-Mixed-Case") == "A" and await r.aread() == b"{}"
        await p.aclose()
