"""h1 against instances that answer too much, forever or in a protocol it does not speak: each is a
typed failure (h1's ``RemoteProtocolError`` or ``ReadTimeout``, or ``ResponseTooLarge``),
bounded in time and memory, and never an exception out of the protocol into the event loop."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from taogate import h1
from tests.transport.test_h1 import pool, read_request, script

Handler = Any


@contextmanager
def loop_errors() -> Iterator[list[dict[str, Any]]]:
    """What reaches the loop's exception handler (a traceback in the log, in production)."""
    loop = asyncio.get_running_loop()
    seen: list[dict[str, Any]] = []
    previous = loop.get_exception_handler()
    loop.set_exception_handler(lambda _loop, context: seen.append(context))
    try:
        yield seen
    finally:
        loop.set_exception_handler(previous)


def answering(*parts: bytes, then_wait: float = 2.0) -> Handler:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        for part in parts:
            writer.write(part)
            await writer.drain()
        await asyncio.sleep(then_wait)

    return handler


async def _fails(handler: Handler, error: type[Exception], match: str, **kw: Any) -> None:
    async with script(handler) as s:
        p = pool(**kw)
        with loop_errors() as seen, pytest.raises(error, match=match):
            r = await p.request(s.origin, b"/", [], b"")
            await r.aread()
        await asyncio.sleep(0.05)  # anything the loop would log has been logged by now
        assert seen == []
        assert p.open_connections == 0
        await p.aclose()


async def test_a_101_switching_protocols_is_a_protocol_error_not_a_traceback() -> None:
    head = b"HTTP/1.1 101 Switching Protocols\r\nupgrade: websocket\r\nconnection: upgrade\r\n\r\nRAW"
    await _fails(answering(head), h1.RemoteProtocolError, "101 Switching Protocols")


async def test_a_malformed_answer_is_a_protocol_error() -> None:
    await _fails(answering(b"HTTP/1.1 2000 Huh\r\n\r\n"), h1.RemoteProtocolError, "malformed")


async def test_a_response_head_over_the_limit_is_refused_early() -> None:
    big = [b"HTTP/1.1 200 OK\r\nx-big: ", *[b"a" * 65536] * 64]  # 4 MiB, never ending
    await _fails(answering(*big), h1.RemoteProtocolError, "head over 8192 bytes", max_header_bytes=8192)


async def test_too_many_response_header_fields_are_refused() -> None:
    fields = b"".join(b"x-%d: v\r\n" % i for i in range(30))
    head = b"HTTP/1.1 200 OK\r\n" + fields + b"content-length: 2\r\n\r\n{}"
    await _fails(answering(head), h1.RemoteProtocolError, "more than 20 response header", max_headers=20)


async def test_endless_interim_replies_are_refused() -> None:
    await _fails(answering(b"HTTP/1.1 100 Continue\r\n\r\n" * 50), h1.RemoteProtocolError, "interim")


async def test_a_head_trickled_for_ever_times_out_in_all() -> None:
    async def trickle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\n")
        for _ in range(100):
            writer.write(b"x-a: b\r\n")
            await asyncio.sleep(0.05)

    await _fails(trickle, h1.ReadTimeout, "kept trickling", read_timeout=0.5)


async def test_trailers_are_not_headers() -> None:
    answer = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\nx-trailer: t\r\n\r\n"
    async with script(answering(answer)) as s:
        p = pool()
        r = await p.request(s.origin, b"/", [], b"")
        assert await r.aread() == b"{}"
        assert [k for k, _ in r.raw_headers] == [b"transfer-encoding"]
        await p.aclose()


async def test_a_whole_body_over_the_limit_is_refused_and_its_connection_aborted() -> None:
    head = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
    chunk = b"%x\r\n%s\r\n" % (65536, b" " * 65536)
    async with script(answering(head, *[chunk] * 64, then_wait=5)) as s:
        p = pool()
        r = await p.request(s.origin, b"/", [], b"")
        with pytest.raises(h1.ResponseTooLarge):
            await r.aread(limit=1 << 20)
        assert p.open_connections == 0
        await p.aclose()


async def test_a_body_trickled_for_ever_times_out_within_the_deadline() -> None:
    async def trickle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        for _ in range(200):
            writer.write(b"1\r\na\r\n")
            await asyncio.sleep(0.02)

    async with script(trickle) as s:
        p = pool(read_timeout=5.0)
        r = await p.request(s.origin, b"/", [], b"")
        loop = asyncio.get_running_loop()
        started = loop.time()
        with pytest.raises(h1.ReadTimeout):
            await r.aread(within=0.3)
        assert loop.time() - started < 2.0
        assert p.open_connections == 0
        await p.aclose()
