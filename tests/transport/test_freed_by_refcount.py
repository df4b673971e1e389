"""A closed connection, client side (the listener's protocol) or instance side (``h1``), is freed by
reference counting the moment it is gone, not by the cycle collector: a reference cycle per
connection keeps every connection of a burst in memory until a full collection, which a large heap
makes rare. Run with the collector off, so a cycle shows as an object that stays."""

from __future__ import annotations

import asyncio
import contextlib
import gc
from collections.abc import Iterator
from typing import Any

from taogate.connection_limits import ListenerLimits
from taogate.h1.connection import Connection
from taogate.listener import LimitedProtocol, protocol_class
from taogate.serving import serve_asgi
from tests.conftest import wait_until
from tests.transport.test_h1 import OK, pool, read_request, script

ROUNDS = 6


@contextlib.contextmanager
def collector_off() -> Iterator[None]:
    gc.collect()
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def alive(cls: type) -> int:
    """Instances of ``cls`` the collector tracks: reachable ones and cyclic garbage alike."""
    return sum(1 for o in gc.get_objects() if isinstance(o, cls))


async def tiny_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            done = message["type"] == "lifespan.shutdown"
            await send({"type": "lifespan.shutdown.complete" if done else "lifespan.startup.complete"})
            if done:
                return
    await receive()
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


async def test_a_closed_client_connection_leaves_no_cycle() -> None:
    async with serve_asgi(tiny_app, http=protocol_class(ListenerLimits())) as served:
        with collector_off():
            before = alive(LimitedProtocol)
            for i in range(ROUNDS):
                reader, writer = await asyncio.open_connection("127.0.0.1", served.port)
                close = b"connection: close\r\n" if i % 2 else b""  # the gateway closes, or the client
                writer.write(b"GET / HTTP/1.1\r\nhost: x\r\n" + close + b"\r\n")
                await reader.readuntil(b"ok")
                writer.close()
                await writer.wait_closed()
            await wait_until(lambda: alive(LimitedProtocol) <= before, what="closed client connections freed")


async def test_a_closed_instance_connection_leaves_no_cycle() -> None:
    async def one_per_connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(OK)  # then the server closes it
        await writer.drain()

    async with script(one_per_connection) as s:
        p = pool(keepalive=0.05)
        with collector_off():
            before = alive(Connection)
            for _ in range(ROUNDS):
                r = await p.request(s.origin, b"/", [], b"")
                assert await r.aread() == b"{}"
            r = await p.request(s.origin, b"/", [], b"")
            r.close()  # an unread answer: the connection is aborted
            await wait_until(lambda: p.open_connections == 0, what="connections closed")
            await wait_until(lambda: alive(Connection) <= before, what="closed connections freed")
        await p.aclose()
