"""``create_app(settings)``: the ASGI application.

Proxied routes (``proxy.routes``: POSTs, and the stored responses under ``/v1/responses/``) are
served by a thin ASGI layer straight into the gateway's request pipeline (no per-request framework
routing, validation or response objects on the hot path). Everything else (health, readiness,
models, metrics, vLLM's /version, /ping and /load, admin) is a small FastAPI app behind it. Both answer
under the plain paths and under the path of ``[gateway] base_url`` (e.g. ``/api/v1/...``).
``serve_gateway`` runs the whole on loopback for the demo, the benchmarks and the tests.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from taogate.admin import admin_router
from taogate.errors import ErrorShape, GatewayError, MethodNotAllowed, NotFound, Unauthorized
from taogate.gateway import Gateway
from taogate.info import info_router
from taogate.observe.dashboard import dashboard
from taogate.observe.exposition import Exposition
from taogate.proxy.routes import RESPONSE_ITEM, RESPONSE_ITEM_PREFIX, ROUTES, Route, error_shapes
from taogate.serving import gateway_server_options, serve_asgi, startup_timeout
from taogate.settings import Settings

log = logging.getLogger("taogate.app")


def unknown_path_message(path: str, prefix: str, base_url: str) -> str:
    """The 404 text: a path already under an API base has the right base_url and a wrong route, so it
    gets the routes; any other path gets the base_url to set."""
    bases = ["/v1"] + ([f"{prefix}/v1"] if prefix else [])
    if any(path == base or path.startswith(base + "/") for base in bases):
        served = ", ".join(r.path for r in ROUTES if r.path.startswith("/v1/"))
        under = f" (and the same under {prefix}/v1)" if prefix else ""
        return (
            f"Unknown path {path}. The gateway serves POST {served}, GET /v1/models{under}, "
            "and POST /tokenize, /detokenize."
        )
    return (
        f"Unknown path {path}. The OpenAI-compatible API lives under /v1"
        + (f" and {prefix}/v1" if prefix else "")
        + f" (e.g. POST /v1/chat/completions); set your client's base_url to {base_url}/v1."
    )


def _error_response(exc: GatewayError, shape: ErrorShape) -> Response:
    headers = {"retry-after": str(exc.retry_after)} if exc.retry_after is not None else None
    return Response(shape.body(exc), status_code=exc.status, media_type="application/json", headers=headers)


def _build_api(gateway: Gateway, prefix: str, errors_at: Callable[[str], ErrorShape]) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await gateway.start()
        try:
            yield
        finally:
            await gateway.stop()

    # No redirect_slashes: its 307 is built from the client's Host header, before any key check.
    api = FastAPI(
        title="taogate",
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
        redirect_slashes=False,
        lifespan=lifespan,
    )
    api.state.gateway = gateway

    # The errors of the routes FastAPI serves, and of paths no route serves, in the shape of the
    # API family the path belongs to (the proxied routes render their own).
    @api.exception_handler(GatewayError)
    async def gateway_error(request: Request, exc: GatewayError) -> Response:
        if isinstance(exc, Unauthorized):
            gateway.metrics.rejections.labels("auth").inc()
        return _error_response(exc, errors_at(request.url.path))

    @api.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        path = request.url.path
        if exc.status_code == 404:
            base_url = gateway.settings.gateway.base_url
            error: GatewayError = NotFound(unknown_path_message(path, prefix, base_url))
        elif exc.status_code == 405:
            error = MethodNotAllowed(f"Method {request.method} is not allowed on {path}.")
        else:
            return Response(
                errors_at(path).refusal(exc.status_code, "invalid_request", str(exc.detail)),
                status_code=exc.status_code,
                media_type="application/json",
            )
        return _error_response(error, errors_at(path))

    @api.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    def can_serve() -> bool:
        now = gateway.clock()
        return gateway.accepting and any(i.available(now) for i in gateway.fleet)

    @api.get("/ready")
    async def ready() -> Response:
        now = gateway.clock()
        if can_serve():
            return JSONResponse({"ready": True})
        return JSONResponse(
            {"ready": False, "instances": gateway.fleet.describe_unavailable(now)}, status_code=503
        )

    async def models(request: Request) -> Response:
        tenant = gateway.keys.check_request(request.scope["headers"], either=True)  # both SDKs list
        cards: dict[str, dict[str, Any]] = {}
        for inst in gateway.fleet:
            for mid, card in inst.model_cards.items():
                if tenant.models is None or mid in tenant.models:  # a key sees what it may use
                    cards.setdefault(mid, card)
        return JSONResponse({"object": "list", "data": [cards[k] for k in sorted(cards)]})

    exposition = Exposition(partial(generate_latest, gateway.registry), time.monotonic)  # CPU: real time

    async def metrics(_: Request) -> Response:
        return Response(exposition.page(), media_type=CONTENT_TYPE_LATEST)

    admin = admin_router(
        gateway.fleet,
        gateway.dispatcher,
        keys=lambda: gateway.keys,
        reload_config=gateway.reload_from_source,
        clock=gateway.clock,
        history=gateway.history,
        dispatch=lambda: gateway.settings.dispatch,
        limiter=gateway.limiter,
    )
    info = info_router(
        gateway.fleet,
        lambda: gateway.client,
        ready=can_serve,
        in_flight=lambda: gateway.pipeline.in_flight,
    )
    for base in {"", prefix}:
        api.add_api_route(f"{base}/v1/models", models, methods=["GET"])
        api.add_api_route(f"{base}/metrics", metrics, methods=["GET"])
        api.include_router(admin, prefix=f"{base}/admin")
        api.add_api_route(f"{base}/dashboard", dashboard, methods=["GET", "HEAD"])
        api.include_router(info, prefix=base)
    return api


class TaogateApp:
    """Routes proxied POSTs straight to the gateway; everything else to the FastAPI app.
    ``server_options``: how uvicorn must serve it (its protocol and limits), whoever serves it;
    ``startup_timeout``: how long its startup may take (the warm-ups' wait included)."""

    def __init__(
        self, gateway: Gateway, api: FastAPI, routes: Mapping[str, Route], server_options: Mapping[str, Any]
    ) -> None:
        self.gateway = gateway
        self.api = api
        self._routes = dict(routes)
        self.server_options = dict(server_options)
        self.startup_timeout = startup_timeout(gateway.settings.dispatch.warmup_wait)
        prefix = gateway.settings.gateway.prefix
        self._items = (RESPONSE_ITEM_PREFIX, prefix + RESPONSE_ITEM_PREFIX)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            path = scope["path"]
            route = self._routes.get(path)
            if route is None and path.startswith(self._items):
                route = RESPONSE_ITEM  # a stored response: /v1/responses/{id}[/cancel]
            if route is not None:
                if scope["method"] in route.methods:
                    await self.gateway.pipeline.handle(route, scope, receive, send)
                    return
                allowed = ", ".join(sorted(route.methods))
                exc = MethodNotAllowed(f"{scope['method']} is not allowed on {path}: use {allowed}.")
                await send(
                    {
                        "type": "http.response.start",
                        "status": 405,
                        "headers": [*exc.headers(), (b"allow", allowed.encode())],
                    }
                )
                await send({"type": "http.response.body", "body": route.errors.body(exc)})
                return
        await self.api(scope, receive, send)


def create_app(
    settings: Settings, *, environ: Mapping[str, str] | None = None, **gateway_kwargs: Any
) -> TaogateApp:
    """Build the gateway and its ASGI app; the gateway starts and stops with the ASGI lifespan."""
    for warning in settings.warnings():
        log.warning("%s", warning)
    gateway = Gateway(settings, environ=environ, **gateway_kwargs)
    prefix = settings.gateway.prefix
    routes = route_table(prefix)
    errors_at = error_shapes(prefix)
    options = gateway_server_options(settings.gateway, settings.upstream_connections(), errors_at)
    return TaogateApp(gateway, _build_api(gateway, prefix, errors_at), routes, options)


def route_table(prefix: str) -> dict[str, Route]:
    """The proxied routes by path, under the plain paths and under ``prefix`` (``base_url``'s)."""
    routes: dict[str, Route] = {}
    for route in ROUTES:
        routes[route.path] = route
        if prefix:
            routes[prefix + route.path] = route
    return routes


@dataclass(frozen=True, slots=True)
class RunningGateway:
    """A gateway served on loopback by ``serve_gateway``: where it is, its key, its app."""

    url: str  # http://127.0.0.1:PORT
    key: str
    app: TaogateApp

    @property
    def api_base(self) -> str:
        return self.url + "/v1"

    @property
    def gateway(self) -> Gateway:
        return self.app.gateway


@asynccontextmanager
async def serve_gateway(
    settings: Settings, *, key: str | None = None, **gateway_kwargs: Any
) -> AsyncIterator[RunningGateway]:
    """The gateway on a free loopback port until the block exits (the demo, benchmarks and tests);
    its unified key is ``key``, or a fresh random one."""
    key = key or secrets.token_urlsafe(24)
    app = create_app(settings, environ={settings.gateway.api_key_env: key}, **gateway_kwargs)
    async with serve_asgi(app) as served:
        yield RunningGateway(served.url, key, app)
