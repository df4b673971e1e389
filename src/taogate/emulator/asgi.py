"""Minimal ASGI plumbing: read a body, send a response, notice the client leaving.

The emulator speaks raw ASGI rather than through a framework so its per-request cost stays close to
uvicorn's own (it doubles as the "direct to vLLM" baseline in benchmarks).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Iterable

from starlette.types import Receive, Scope, Send

__all__ = [
    "header",
    "read_body",
    "send_bytes",
    "start_stream",
    "watch_disconnect",
]


JSON = b"application/json"


def header(scope: Scope, name: bytes) -> str | None:
    """First value of a request header (``name`` lower-case), decoded as latin-1 per HTTP."""
    for key, value in scope["headers"]:
        if key == name:
            return str(value.decode("latin-1"))
    return None


async def read_body(receive: Receive) -> bytes | None:
    """The whole request body, or ``None`` if the client disconnected first."""
    chunks: list[bytes] = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


async def send_bytes(
    send: Send,
    status: int,
    body: bytes,
    content_type: bytes | None = JSON,
    headers: Iterable[tuple[bytes, bytes]] = (),
) -> None:
    """A whole response; ``content_type`` None sends none (vLLM's empty ``/health`` and ``/ping``)."""
    head = [(b"content-type", content_type)] if content_type is not None else []
    head.append((b"content-length", str(len(body)).encode()))
    await send({"type": "http.response.start", "status": status, "headers": [*head, *headers]})
    await send({"type": "http.response.body", "body": body})


async def start_stream(send: Send, headers: Iterable[tuple[bytes, bytes]] = ()) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [(b"content-type", b"text/event-stream; charset=utf-8"), *headers],
        }
    )


async def _wait_disconnect(receive: Receive, on_disconnect: Callable[[], object]) -> None:
    # Bounded by the connection's life: the server always ends with http.disconnect.
    while (await receive())["type"] != "http.disconnect":
        pass
    on_disconnect()


@contextlib.asynccontextmanager
async def watch_disconnect(
    receive: Receive, on_disconnect: Callable[[], object]
) -> AsyncIterator[asyncio.Task[None]]:
    """Call ``on_disconnect`` if the client goes away while the block runs; yields the watcher task.

    Only use after the body has been read: the watcher consumes every further ``receive`` message.
    """
    task = asyncio.get_running_loop().create_task(_wait_disconnect(receive, on_disconnect))
    try:
        yield task
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
