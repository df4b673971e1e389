"""``taogate pick``: the gateway's parts with two front ends, gRPC for the picks and HTTP for people.

The parts are built by ``create_app``, as for ``serve``; its HTTP application (health, readiness,
metrics, admin API, fleet page) is served on the HTTP port, and its lifespan starts and stops the
gateway (probes, scrapes, KV events). The gRPC server carries the ext_proc service and the gRPC
health service (``liveness``, ``readiness`` and the ext_proc service's name, as the protocol asks).
Stopping: health says NOT_SERVING, streams in flight get ``shutdown_timeout``, then the HTTP side
and the gateway stop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from taogate.app import TaogateApp, create_app, route_table
from taogate.picker.admit import Admission
from taogate.picker.servicer import Picker
from taogate.serving import serve_asgi
from taogate.settings import ConfigError, Settings

__all__ = ["HEALTH_SERVICES", "RunningPicker", "run_picker", "serve_picker"]

HEALTH_SERVICES = ("", "liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor")


@dataclass(frozen=True, slots=True)
class RunningPicker:
    grpc_port: int
    http_url: str
    app: TaogateApp
    server: Any  # grpc.aio.Server


@contextlib.asynccontextmanager
async def serve_picker(
    settings: Settings,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    http_port: int = 0,
    check_key: bool = True,
    environ: Mapping[str, str] | None = None,
    **gateway_kwargs: Any,
) -> AsyncIterator[RunningPicker]:
    """The picker until the block exits (port 0: a free one); the gateway runs with the HTTP side."""
    app = create_app(settings, environ=environ, **gateway_kwargs)
    gateway = app.gateway
    admission = Admission(gateway, route_table(settings.gateway.prefix), check_key=check_key)
    within = app.startup_timeout
    graceful = settings.gateway.shutdown_timeout
    async with serve_asgi(app.api, host, http_port, graceful=graceful, startup=within) as served:
        server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        pb_grpc.add_ExternalProcessorServicer_to_server(Picker(gateway, admission), server)
        checks = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(checks, server)
        bound = server.add_insecure_port(f"{host}:{port}" if ":" not in host else f"[{host}]:{port}")
        await server.start()
        for name in HEALTH_SERVICES:
            await checks.set(name, health_pb2.HealthCheckResponse.SERVING)
        try:
            yield RunningPicker(bound, served.url, app, server)
        finally:
            for name in HEALTH_SERVICES:
                await checks.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
            gateway.pipeline.accepting = False
            await server.stop(settings.gateway.shutdown_timeout)


async def run_picker(
    settings: Settings,
    *,
    port: int,
    http_port: int,
    check_key: bool,
    source: Callable[[], Settings] | None,
    access_sink: Callable[[str], None] | None,
    on_ready: Callable[[RunningPicker], None],
) -> None:
    """``taogate pick``: serve until SIGTERM or SIGINT; SIGHUP reloads the config."""
    host = settings.gateway.host
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with serve_picker(
        settings,
        host=host,
        port=port,
        http_port=http_port,
        check_key=check_key,
        settings_source=source,
        access_sink=access_sink,
    ) as running:
        if source is not None and hasattr(signal, "SIGHUP"):
            loop.add_signal_handler(signal.SIGHUP, lambda: _reload(running.app))
        on_ready(running)
        await stop.wait()


def _reload(app: TaogateApp) -> None:
    try:
        app.gateway.reload_from_source()
    except ConfigError as exc:
        logging.getLogger("taogate").error("reload refused, the running config stays: %s", exc)
