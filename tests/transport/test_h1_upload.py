"""h1 sending a body as it arrives (uploads): chunked or sized, as fast as the server reads it, and
what happens when the server answers early, hangs up, reads nothing, or the body's source fails."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from taogate import h1
from tests.transport.test_h1 import OK, pool, read_request, script


class SourceFailed(Exception):
    """The body's own source failed (as a client that leaves mid-upload)."""


async def pieces(*chunks: bytes, gap: float = 0.0, fail: bool = False) -> AsyncIterator[bytes]:
    for chunk in chunks:
        if gap:
            await asyncio.sleep(gap)
        yield chunk
    if fail:
        raise SourceFailed


async def read_chunked(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    body = b""
    while True:
        size = int((await reader.readuntil(b"\r\n"))[:-2], 16)
        data = await reader.readexactly(size + 2)
        if size == 0:
            return head, body
        body += data[:-2]


async def test_a_body_without_a_length_goes_chunked_on_a_fresh_connection_then_kept() -> None:
    seen: list[tuple[bytes, bytes]] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen.append(await read_chunked(reader))
        writer.write(OK)
        await read_request(reader)
        writer.write(OK)

    async with script(handler) as s:
        p = pool()
        r = await p.request(s.origin, b"/v1/up", [], pieces(b"ab", b"", b"cd", gap=0.01))
        assert (r.status_code, await r.aread()) == (200, b"{}")
        r = await p.request(s.origin, b"/v1/x", [], b"{}")  # a held body reuses it
        assert (r.status_code, await r.aread()) == (200, b"{}")
        assert s.connections == 1 and p.idle_connections == 1
        await p.aclose()
    head, body = seen[0]
    assert b"transfer-encoding: chunked\r\n" in head and b"content-length" not in head
    assert body == b"abcd"


async def test_a_body_with_its_length_goes_as_it_is() -> None:
    seen: list[bytes] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen.append(await read_request(reader))
        writer.write(OK)

    async with script(handler) as s:
        p = pool()
        r = await p.request(s.origin, b"/v1/up", [(b"content-length", b"6")], pieces(b"abc", b"def"))
        assert r.status_code == 200
        await r.aread()
        await p.aclose()
    assert seen[0].endswith(b"content-length: 6\r\n\r\nabcdef") and b"chunked" not in seen[0]


async def test_a_slow_reader_holds_the_sender_back_and_a_silent_one_times_it_out() -> None:
    async def never_reads(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await asyncio.sleep(30)

    sent = 0

    async def endless() -> AsyncIterator[bytes]:
        nonlocal sent
        piece = b"x" * 65536
        while sent < 1 << 30:
            sent += len(piece)
            yield piece

    async with script(never_reads) as s:
        p = pool(read_timeout=0.5)
        with pytest.raises(h1.WriteTimeout, match="read none of the request body"):
            await p.request(s.origin, b"/v1/up", [], endless())
        assert sent < 64 << 20  # flow control: not a gigabyte buffered in memory
        assert p.open_connections == 0
        await p.aclose()


async def test_an_early_answer_stops_the_body_and_the_connection_is_not_reused() -> None:
    async def refuses(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        body = b'{"error":"too large"}'
        writer.write(b"HTTP/1.1 413 Too Large\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
        await writer.drain()
        await asyncio.sleep(5)

    async with script(refuses) as s:
        p = pool()
        r = await p.request(s.origin, b"/v1/up", [], pieces(*[b"x" * 1024] * 50, gap=0.02))
        assert (r.status_code, await r.aread()) == (413, b'{"error":"too large"}')
        assert p.open_connections == 0 and p.idle_connections == 0
        await p.aclose()


async def test_a_server_that_hangs_up_mid_body_is_a_write_error() -> None:
    async def hangs_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")

    async with script(hangs_up) as s:
        p = pool()
        with pytest.raises((h1.WriteError, h1.RemoteProtocolError)):
            await p.request(s.origin, b"/v1/up", [], pieces(*[b"x" * 1024] * 50, gap=0.02))
        assert p.open_connections == 0
        await p.aclose()


async def test_the_bodys_own_failure_propagates_and_aborts_the_connection() -> None:
    got_end = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        while await reader.read(65536):
            pass
        got_end.set()

    async with script(handler) as s:
        p = pool()
        with pytest.raises(SourceFailed):
            await p.request(s.origin, b"/v1/up", [], pieces(b"abc", fail=True))
        await asyncio.wait_for(got_end.wait(), 5)  # the server saw the connection end
        assert p.open_connections == 0
        await p.aclose()


async def test_a_body_failing_after_a_whole_early_answer_does_not_hand_its_connection_on() -> None:
    """The instance answered in full before the body's source failed: it still waits for the rest
    of the declared body, so a next request sent on that connection would be read as that body."""
    answered = asyncio.Event()

    async def answers_early(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(OK)
        await writer.drain()
        answered.set()
        while await reader.read(65536):
            pass

    async def then_fails() -> AsyncIterator[bytes]:
        yield b"x" * 10
        await answered.wait()
        await asyncio.sleep(0.1)  # the whole answer is read meanwhile
        raise SourceFailed

    async with script(answers_early) as s:
        p = pool()
        with pytest.raises(SourceFailed):
            await p.request(s.origin, b"/v1/up", [(b"content-length", b"100000")], then_fails())
        assert p.open_connections == 0 and p.idle_connections == 0
        await p.aclose()
