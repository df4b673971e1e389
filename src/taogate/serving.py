"""Running the gateway (or an emulator) under uvicorn inside an event loop of our own.

``taogate serve`` runs ``Server`` with uvicorn's own signal handling (SIGTERM drains); the demo, the
benchmarks and the tests use ``serve_asgi``, which binds its socket first (port 0 → a free port,
read back before serving: no port race) and awaits startup through uvicorn's own hook, never a sleep.
Both serve the gateway with ``gateway_server_options``: its protocol and its limits, so what the
tests exercise is what runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import resource
import socket
from collections.abc import AsyncIterator, Callable, Generator
from dataclasses import dataclass
from typing import Any

import uvicorn

from taogate.connection_limits import ListenerLimits
from taogate.errors import ErrorShape, openai_everywhere
from taogate.gateway_settings import GatewaySettings
from taogate.listener import protocol_class

#: How long an app's startup may take before ``serve_asgi`` gives up: a gateway's runs a DNS lookup
#: and a probe round (15 s was seen to fall short against busy engines on the real tier), then
#: waits up to ``[dispatch] warmup_wait`` more for the warm-ups (``startup_timeout``).
_STARTUP_TIMEOUT_S = 60.0
#: File descriptors kept beside the client connections: the upstream pool's, the control plane's,
#: the listening socket, logs, and room for the instances' probes.
_FD_RESERVE = 128

log = logging.getLogger("taogate.serving")


def open_file_limit() -> int:
    """Raise the soft limit on open files to the hard one (a proxy holds a descriptor per
    connection, and the default soft limit is often 1024); returns the limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft != resource.RLIM_INFINITY and soft < want:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


def gateway_server_options(
    cfg: GatewaySettings, upstream: int, errors_at: Callable[[str], ErrorShape] = openai_everywhere
) -> dict[str, Any]:
    """uvicorn options for the gateway: its protocol with the client limits of ``cfg``, no upgrades,
    its keep-alive, and nothing of uvicorn's own that the gateway does itself. ``upstream``: the
    connections to the instances, whose file descriptors the clients' leave room for; ``errors_at``:
    the error shape of a refusal, by the request's path."""
    fits = open_file_limit() - upstream - _FD_RESERVE
    connections = max(16, min(cfg.max_client_connections, fits))
    if connections < cfg.max_client_connections:
        log.warning(
            "[gateway] max_client_connections lowered from %d to %d to fit the open-file limit "
            "(raise it with ulimit -n or LimitNOFILE=)",
            cfg.max_client_connections,
            connections,
        )
    limits = ListenerLimits(
        max_header_bytes=cfg.max_header_bytes,
        max_headers=cfg.max_headers,
        max_url_bytes=cfg.max_url_bytes,
        header_timeout=cfg.header_timeout,
        max_connections=connections,
        # A backstop for the writes outside a stream's relay (a whole answer, a stream's head),
        # which drops a stalled client itself at 1x and says so.
        write_stall=2 * cfg.client_stall_timeout,
        errors_at=errors_at,
    )
    return {
        "http": protocol_class(limits),
        "ws": "none",
        "timeout_keep_alive": cfg.keepalive_timeout,
        "access_log": False,  # the gateway writes its own line per request
        "proxy_headers": False,  # the client address is the peer's, never what X-Forwarded-For claims
        "server_header": False,
    }


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop when installed, for ``asyncio.Runner``: uvicorn's ``loop="auto"`` only applies when
    uvicorn owns the loop, and our commands run uvicorn inside a loop of their own."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop ships with uvicorn[standard]
        return None
    return uvloop.new_event_loop


def tune_runtime() -> None:
    """A long-lived proxy allocates many short-lived objects and few cycles: move everything built at
    start-up out of the collector's view and collect the young generation less often (it costs less
    CPU per proxied request: ``benchmarks/overhead.py``)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(50_000, 20, 20)


class Server(uvicorn.Server):
    """uvicorn's server that says when it is listening (``listening``) and runs ``after_shutdown``
    once shut down: after a caught SIGTERM uvicorn re-raises the signal as it returns, and the
    process ends before any code after ``serve()``. ``own_signals=False`` leaves signals to the host
    (an embedded server must not take over the demo's or a test's Ctrl-C)."""

    def __init__(
        self,
        config: uvicorn.Config,
        *,
        own_signals: bool = True,
        after_shutdown: Callable[[], None] | None = None,
    ) -> None:
        super().__init__(config)
        self.listening = asyncio.Event()
        self._own_signals = own_signals
        self._after_shutdown = after_shutdown

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        if self._own_signals:
            with super().capture_signals():
                yield
        else:
            yield

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        self.listening.set()

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        try:
            await super().shutdown(sockets)
        finally:
            if self._after_shutdown is not None:
                self._after_shutdown()

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
    server: Server


def startup_timeout(warmup_wait: float) -> float:
    """How long a gateway's startup may take, its warm-ups' wait included."""
    return _STARTUP_TIMEOUT_S + warmup_wait


@contextlib.asynccontextmanager
async def serve_asgi(
    app: Any,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    graceful: float = 5.0,
    startup: float = _STARTUP_TIMEOUT_S,
    **config: Any,
) -> AsyncIterator[Served]:
    """Serve ``app`` until the block exits; lifespan runs, so the app's startup (``startup``
    seconds at most) is done on entry. An app with ``server_options`` (the gateway) is served with
    them, and within its own ``startup_timeout``."""
    startup = getattr(app, "startup_timeout", startup)
    sock = bind_socket(host, port)
    bound = sock.getsockname()[1]
    options: dict[str, Any] = {
        "log_config": None,
        "log_level": "warning",
        "access_log": False,
        "lifespan": "on",
        "server_header": False,
        "timeout_graceful_shutdown": max(1, int(graceful)),
        **getattr(app, "server_options", {}),
        **config,
    }
    server = Server(uvicorn.Config(app, host=host, port=bound, **options), own_signals=False)
    task = asyncio.get_running_loop().create_task(server.serve(sockets=[sock]), name=f"serve-{bound}")
    ready = asyncio.ensure_future(server.listening.wait())
    done, _ = await asyncio.wait({task, ready}, timeout=startup, return_when=asyncio.FIRST_COMPLETED)
    if ready not in done:
        ready.cancel()
        server.request_exit()
        await asyncio.gather(task, return_exceptions=True)
        sock.close()
        if task.done() and not task.cancelled() and task.exception() is not None:
            raise RuntimeError(f"server on port {bound} failed to start") from task.exception()
        raise RuntimeError(f"server on port {bound} did not start in {startup:g}s")
    try:
        yield Served(f"http://{host}:{bound}", bound, server)
    finally:
        server.request_exit()
        await asyncio.gather(task, return_exceptions=True)
        sock.close()
