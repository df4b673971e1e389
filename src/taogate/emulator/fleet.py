"""Run emulated vLLM instances in-process: ``async with run_fleet([...]) as fleet``.

Each instance is a uvicorn server on the current event loop, listening on a socket we bind ourselves
(port 0 → the OS picks a free port, read back before serving), so there is no port race and no sleep:
startup is awaited through uvicorn's own ``startup`` hook. Signals are left to the host process (tests,
the gateway's demo, or the CLI, which installs its own handlers), since several servers share a loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

import uvicorn

from taogate.emulator.app import create_emulator_app
from taogate.emulator.clock import Clock
from taogate.emulator.config import EmulatorConfig
from taogate.emulator.generation import MidStreamClose
from taogate.emulator.instance import EmulatorInstance
from taogate.serving import Server, bind_socket

__all__ = ["Fleet", "quiet_fault_tracebacks", "run_fleet"]

# Seconds uvicorn waits for open requests at shutdown before cancelling them (a backstop: the fleet
# releases everything in flight first).
_GRACEFUL_SHUTDOWN_S = 2
_STARTUP_TIMEOUT_S = 10.0


class _DropFaultTracebacks(logging.Filter):
    """``close_mid_stream`` works by raising in the app; that is intended, so keep it out of the logs."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not isinstance(exc, MidStreamClose)


def quiet_fault_tracebacks() -> None:
    """Install (once) the filter that hides the intended ``close_mid_stream`` tracebacks."""
    logger = logging.getLogger("uvicorn.error")
    if not any(isinstance(f, _DropFaultTracebacks) for f in logger.filters):
        logger.addFilter(_DropFaultTracebacks())


@dataclass(frozen=True, slots=True)
class Fleet:
    """Running instances: ``urls[i]`` (no ``/v1``) serves ``instances[i]``."""

    instances: list[EmulatorInstance]
    urls: list[str]
    ports: list[int]


async def _serve_until_listening(server: Server, sock: socket.socket) -> asyncio.Task[None]:
    task = asyncio.get_running_loop().create_task(server.serve(sockets=[sock]), name="emulator-server")
    ready = asyncio.ensure_future(server.listening.wait())
    done, _ = await asyncio.wait(
        {task, ready}, timeout=_STARTUP_TIMEOUT_S, return_when=asyncio.FIRST_COMPLETED
    )
    if ready in done:
        return task
    ready.cancel()
    sock.close()
    if task.done():
        task.result()  # re-raise the startup failure (uvicorn exits with SystemExit)
    server.request_exit()
    await asyncio.gather(task, return_exceptions=True)
    raise RuntimeError("emulator server did not start listening in time")


@contextlib.asynccontextmanager
async def run_fleet(
    configs: Sequence[EmulatorConfig],
    host: str = "127.0.0.1",
    ports: Sequence[int] | None = None,
    *,
    clock: Clock | None = None,
) -> AsyncIterator[Fleet]:
    """Start one emulator per config on the running loop; stop them all cleanly on exit.

    ``ports`` (same length as ``configs``) pins ports; by default each gets a free port.
    """
    if ports is not None and len(ports) != len(configs):
        raise ValueError(f"got {len(ports)} ports for {len(configs)} configs")
    quiet_fault_tracebacks()
    servers: list[Server] = []
    tasks: list[asyncio.Task[None]] = []
    instances: list[EmulatorInstance] = []
    bound: list[int] = []
    try:
        for i, config in enumerate(configs):
            app = create_emulator_app(config, clock)
            sock = bind_socket(host, ports[i] if ports is not None else 0)
            bound.append(sock.getsockname()[1])
            server = Server(
                uvicorn.Config(
                    app,
                    host=host,
                    port=bound[-1],
                    log_config=None,  # leave the host's logging alone
                    log_level="warning",
                    access_log=False,
                    lifespan="on",
                    timeout_graceful_shutdown=_GRACEFUL_SHUTDOWN_S,
                ),
                own_signals=False,
            )
            servers.append(server)
            instances.append(app.instance)
            tasks.append(await _serve_until_listening(server, sock))
        authority = f"[{host}]" if ":" in host else host
        yield Fleet(instances, [f"http://{authority}:{p}" for p in bound], bound)
    finally:
        for instance in instances:
            await instance.aclose()  # release in-flight requests so servers stop at once
        for server in servers:
            server.request_exit()
        await asyncio.gather(*tasks, return_exceptions=True)
