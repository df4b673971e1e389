"""Reference proxies, to calibrate the overhead benchmark against the figures its target was set by.

One FastAPI proxy with two HTTP clients, "aiohttp directly" at ~300 µs of CPU per request and
httpx's default transport at ~1,900 µs, measured when taogate's target (≤ 400 µs) was set beside
them. This machine is shared, so an absolute figure moves with its neighbours; running those
same proxies in the same rounds as taogate turns the target into ratios that hold whatever the
machine is doing (400/300 ≈ 1.33x the aiohttp proxy, 400/1,900 ≈ 0.21x the httpx one).

What it is: FastAPI under uvicorn (uvloop, httptools), one route per proxied path, the request body
read once and forwarded verbatim to the upstreams in turn, the answer returned whole (aiohttp also
relays a stream chunk by chunk). No auth, dispatch, retries, metrics or logging: the floor of a
Python proxy built the usual way.

Two floors of taogate's own stack, forwarding over its ``h1`` pool with none of its features:
``bare``, a raw ASGI app on the gateway's own listener (``taogate.listener`` under uvicorn), and
``raw``, an httptools protocol of its own with no uvicorn and no ASGI (what the listener's ASGI
cycle costs on top).

    python benchmarks/reference_proxy.py --client aiohttp --port P http://127.0.0.1:A ...
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager
from typing import Any, cast

import aiohttp
import httptools
import httpx
import uvicorn
import uvloop
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from taogate.connection_limits import ListenerLimits
from taogate.h1 import Origin, Pool
from taogate.listener import protocol_class

DROPPED_HEADERS = {"connection", "keep-alive", "transfer-encoding", "content-length", "host", "authorization"}
Forward = Callable[[str, bytes, dict[str, str]], Awaitable[Response]]


def aiohttp_client() -> tuple[Forward, Callable[[], Awaitable[None]]]:
    session: aiohttp.ClientSession | None = None

    async def forward(url: str, body: bytes, headers: dict[str, str]) -> Response:
        nonlocal session
        if session is None:  # created inside the server's loop
            connector = aiohttp.TCPConnector(limit=64, limit_per_host=0, keepalive_timeout=3)
            session = aiohttp.ClientSession(connector=connector)
        upstream = await session.post(url, data=body, headers=headers)
        media = upstream.headers.get("content-type", "application/json")
        if media.startswith("text/event-stream"):

            async def chunks() -> AsyncIterator[bytes]:
                try:
                    async for chunk in upstream.content.iter_any():
                        yield chunk
                finally:
                    upstream.release()

            return StreamingResponse(chunks(), status_code=upstream.status, media_type=media)
        async with upstream:
            content = await upstream.read()
        return Response(content, status_code=upstream.status, media_type=media)

    async def close() -> None:
        if session is not None:
            await session.close()

    return forward, close


def httpx_client() -> tuple[Forward, Callable[[], Awaitable[None]]]:
    client = httpx.AsyncClient(limits=httpx.Limits(max_connections=64), timeout=30, trust_env=False)

    async def forward(url: str, body: bytes, headers: dict[str, str]) -> Response:
        upstream = await client.post(url, content=body, headers=headers)
        media = upstream.headers.get("content-type", "application/json")
        return Response(upstream.content, status_code=upstream.status_code, media_type=media)

    return forward, client.aclose


CLIENTS = {"aiohttp": aiohttp_client, "httpx": httpx_client}
BARE, RAW = "bare", "raw"
KEPT_HEADERS = (b"content-type", b"authorization")


def bare(upstreams: list[str]) -> Callable[..., Awaitable[None]]:
    """The floor of taogate's own stack: a raw ASGI app (no FastAPI) on the gateway's listener,
    forwarding over taogate's ``h1`` pool to the upstreams in turn, the answer returned whole. What
    a proxied request costs on this stack before any of the gateway's features."""
    origins = itertools.cycle([Origin.parse(u) for u in upstreams])
    pool = Pool(64, connect_timeout=5.0, read_timeout=30.0, pool_timeout=30.0)

    async def app(
        scope: dict[str, object], receive: Callable[..., Awaitable[dict[str, object]]], send: Any
    ) -> None:
        if scope["type"] != "http":
            return
        if scope["method"] != "POST":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b""})
            return
        body = b""
        more = True
        while more:
            message = await receive()
            body += message.get("body", b"")  # type: ignore[operator]
            more = bool(message.get("more_body"))
        headers = [(k, v) for k, v in scope["headers"] if k in KEPT_HEADERS]  # type: ignore[attr-defined]
        path = str(scope["path"]).encode()
        r = await pool.request(next(origins), path, headers, body)
        content = await r.aread()
        out = [(b"content-type", r.header("content-type").encode() or b"application/json")]
        await send({"type": "http.response.start", "status": r.status_code, "headers": out})
        await send({"type": "http.response.body", "body": content})

    return app


class RawProtocol(asyncio.Protocol):
    """``raw``: the same forwarding as ``bare`` on an httptools protocol of its own, without uvicorn
    or ASGI (keep-alive, one request at a time per connection, no limits): what uvicorn's cycle
    costs on top. A measuring stick, not a server to run."""

    def __init__(self, origins: Iterator[Origin], pool: Pool) -> None:
        self._origins = origins
        self._pool = pool
        self._parser = httptools.HttpRequestParser(self)
        self._transport: asyncio.Transport | None = None
        self._url = b""
        self._headers: list[tuple[bytes, bytes]] = []
        self._body: list[bytes] = []
        self._tasks: set[asyncio.Task[None]] = set()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        self._parser.feed_data(data)

    def on_message_begin(self) -> None:
        self._url, self._headers, self._body = b"", [], []

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        name = name.lower()
        if name in KEPT_HEADERS:
            self._headers.append((name, value))

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        method = self._parser.get_method()
        task = asyncio.get_running_loop().create_task(self._answer(method, self._url, b"".join(self._body)))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _answer(self, method: bytes, url: bytes, body: bytes) -> None:
        assert self._transport is not None
        if method != b"POST":
            self._transport.write(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
            return
        r = await self._pool.request(next(self._origins), url, self._headers, body)
        content = await r.aread()
        media = r.header("content-type").encode() or b"application/json"
        head = b"HTTP/1.1 %d OK\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n" % (
            r.status_code,
            media,
            len(content),
        )
        self._transport.write(head + content)


async def serve_raw(port: int, upstreams: list[str]) -> None:
    origins = itertools.cycle([Origin.parse(u) for u in upstreams])
    pool = Pool(64, connect_timeout=5.0, read_timeout=30.0, pool_timeout=30.0)
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: RawProtocol(origins, pool), "127.0.0.1", port)
    async with server:
        await server.serve_forever()


def build(upstreams: list[str], client: str) -> FastAPI:
    forward, close = CLIENTS[client]()
    turn = itertools.cycle(upstreams)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        try:
            yield
        finally:
            await close()

    app = FastAPI(lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    @app.get("/health")
    @app.get("/ready")
    async def ready() -> Response:
        return Response(status_code=200)

    @app.post("/v1/completions")
    @app.post("/v1/chat/completions")
    async def proxy(request: Request) -> Response:
        body = await request.body()
        headers = {k: v for k, v in request.headers.items() if k not in DROPPED_HEADERS}
        return await forward(next(turn) + request.url.path, body, headers)

    return app


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--client", choices=sorted([*CLIENTS, BARE, RAW]), default="aiohttp")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("upstreams", nargs="+", help="base URLs of the emulators")
    args = p.parse_args()
    if args.client == RAW:
        uvloop.run(serve_raw(args.port, args.upstreams))
        return
    app: Any = build(args.upstreams, args.client) if args.client != BARE else bare(args.upstreams)
    options: dict[str, Any] = {"http": "httptools"}
    if args.client == BARE:  # served as the gateway is: its listener (default limits), no extras
        options = {
            "http": protocol_class(ListenerLimits()),
            "ws": "none",
            "proxy_headers": False,
            "server_header": False,
        }
    options.update(host="127.0.0.1", port=args.port, log_level="warning", access_log=False, loop="uvloop")
    uvicorn.run(app, **options)


if __name__ == "__main__":
    main()
