"""An emulated fleet, or a gateway, in a process of its own, for benchmarks that judge dispatch.

In one process, the gateway's and the load generator's CPU delays the emulated engines' step timers:
the "GPU" then slows down when the gateway works, which no real GPU does, and the rows that carry a
gateway are measured on slower engines than the pooled bound (measured: benchmarks/dispatch.py).
Here each server runs in a child Python process on 127.0.0.1, started from a pickled description,
and says ``ready URL`` on stdout once listening; the parent reads emulator stats over HTTP.

    async with fleet_process(configs) as urls: ...
    async with gateway_process(settings, key) as url: ...

The child is stopped when the block exits: SIGTERM, then SIGKILL after a bounded wait, or at once if
the block is cancelled meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import pickle
import signal
import sys
import tempfile
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any

import httpx

from taogate.bench.procs import launch
from taogate.emulator.config import EmulatorConfig

__all__ = ["fleet_process", "fleet_stats", "gateway_process"]

READY = "ready "
START_TIMEOUT_S = 60.0


@contextlib.asynccontextmanager
async def _child(
    kind: str, payload: Any, count: int, on_pid: Callable[[int], None] | None = None
) -> AsyncIterator[list[str]]:
    """Run ``python -m taogate.bench.isolated KIND FILE`` and yield the ``count`` URLs it announces."""
    with tempfile.TemporaryDirectory(prefix="taogate-isolated-") as tmp:
        spec = Path(tmp) / "spec.pickle"
        spec.write_bytes(pickle.dumps(payload))
        cmd = [sys.executable, "-m", "taogate.bench.isolated", kind, str(spec)]
        launched = launch(
            cmd, name=f"isolated {kind}", ready_prefix=READY, ready_count=count, ready_within=START_TIMEOUT_S
        )
        async with launched as child:
            if on_pid is not None:
                on_pid(child.pid)
            yield child.urls


def fleet_process(configs: Sequence[EmulatorConfig]) -> contextlib.AbstractAsyncContextManager[list[str]]:
    """One emulator per config, all in one child process; yields their base URLs in order."""
    return _child("fleet", list(configs), len(configs))


@contextlib.asynccontextmanager
async def gateway_process(
    settings: Any, key: str, on_pid: Callable[[int], None] | None = None
) -> AsyncIterator[str]:
    """taogate (``settings``, the unified key ``key``) in a child process; yields its root URL
    (``on_pid`` is told the child's pid, e.g. to read its memory)."""
    async with _child("gateway", (settings, key), 1, on_pid) as urls:
        yield urls[0]


async def fleet_stats(urls: Sequence[str]) -> list[dict[str, Any]]:
    """Each emulator's own books (``GET /emulator/stats``), in order."""
    async with httpx.AsyncClient(timeout=10, trust_env=False) as client:
        replies = [await client.get(u + "/emulator/stats") for u in urls]
    return [r.json() for r in replies]


# -- the child -------------------------------------------------------------------------------------
async def _serve(kind: str, payload: Any) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if kind == "fleet":
        from taogate.emulator.fleet import run_fleet

        async with run_fleet(payload) as fleet:
            _announce(fleet.urls)
            await stop.wait()
        return
    from taogate.app import create_app
    from taogate.serving import serve_asgi, tune_runtime

    settings, key = payload
    application = create_app(settings, environ={settings.gateway.api_key_env: key})
    tune_runtime()  # as ``taogate serve`` does
    async with serve_asgi(application) as served:
        _announce([served.url])
        await stop.wait()


def _announce(urls: Sequence[str]) -> None:
    """Say ``ready URL`` on stdout, then send stdout to stderr: nobody reads the pipe after the ready
    lines, and a full pipe would block this process's event loop (and its emulated engines)."""
    for url in urls:
        print(READY + url, flush=True)
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())


def main(argv: Sequence[str]) -> None:
    kind, spec = argv
    if kind not in ("fleet", "gateway"):
        raise SystemExit(f"unknown kind {kind!r}: fleet or gateway")
    from taogate.serving import loop_factory

    payload = pickle.loads(Path(spec).read_bytes())
    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        runner.run(_serve(kind, payload))


if __name__ == "__main__":
    main(sys.argv[1:])
