"""Run an ASGI app under uvicorn inside the current event loop, on a socket we bind ourselves.

Used by the demo, the benchmarks and the tests: binding first (port 0 → a free port, read back
before serving) means no port race, and startup is awaited through uvicorn's own hook, never a sleep.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Callable, Generator
from dataclasses import dataclass
from typing import Any

import uvicorn

_STARTUP_TIMEOUT_S = 15.0


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop when installed, for ``asyncio.Runner``: uvicorn's ``loop="auto"`` only applies when
    uvicorn owns the loop, and our commands run uvicorn inside a loop of their own."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop ships with uvicorn[standard]
        return None
    return uvloop.new_event_loop


class EmbeddedServer(uvicorn.Server):
    """A uvicorn server that leaves signals to its host and says when it is listening."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.listening = asyncio.Event()

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        self.listening.set()

    def request_exit(self) -> None:
        """Ask the server to stop, as a signal would (graceful: open requests get a moment)."""
        self.should_exit = True


def bind_socket(host: str, port: int) -> socket.socket:
    """A bound TCP socket. ``IPPROTO_TCP`` must be explicit: asyncio only sets ``TCP_NODELAY`` on
    accepted sockets whose protocol says TCP, and without it every small response pays Nagle +
    delayed-ACK (~40 ms on loopback)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


@dataclass(frozen=True, slots=True)
class Served:
    url: str  # http://host:port
    port: int
    server: EmbeddedServer


@contextlib.asynccontextmanager
async def serve_asgi(
    app: Any, host: str = "127.0.0.1", port: int = 0, *, graceful: float = 5.0, **config: Any
) -> AsyncIterator[Served]:
    """Serve ``app`` until the block exits; lifespan runs, so the app's startup is done on entry."""
    sock = bind_socket(host, port)
    bound = sock.getsockname()[1]
    server = EmbeddedServer(
        uvicorn.Config(
            app,
            host=host,
            port=bound,
            log_config=None,
            log_level="warning",
            access_log=False,
            lifespan="on",
            server_header=False,
            timeout_graceful_shutdown=max(1, int(graceful)),
            **config,
        )
    )
    task = asyncio.get_running_loop().create_task(server.serve(sockets=[sock]), name=f"serve-{bound}")
    ready = asyncio.ensure_future(server.listening.wait())
    done, _ = await asyncio.wait(
        {task, ready}, timeout=_STARTUP_TIMEOUT_S, return_when=asyncio.FIRST_COMPLETED
    )
    if ready not in done:
        ready.cancel()
        server.request_exit()
        await asyncio.gather(task, return_exceptions=True)
        sock.close()
        if task.done() and not task.cancelled() and task.exception() is not None:
            raise RuntimeError(f"server on port {bound} failed to start") from task.exception()
        raise RuntimeError(f"server on port {bound} did not start in {_STARTUP_TIMEOUT_S:g}s")
    try:
        yield Served(f"http://{host}:{bound}", bound, server)
    finally:
        server.request_exit()
        await asyncio.gather(task, return_exceptions=True)
        sock.close()
