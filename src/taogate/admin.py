"""Admin endpoints (need the admin key, or the unified key when none is set).

GET  /admin/instances               one row per instance, side by side, and the gateway's own side
GET  /admin/history[?since=T]       the last few minutes, one frame a second (the dashboard's charts)
GET  /admin/keys                    one row per client key: its limits and what it used here
POST /admin/instances/{name}/drain  no new work; in-flight requests finish (rolling restarts)
POST /admin/instances/{name}/undrain
POST /admin/reload                  re-read the config files; an invalid config is refused
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Depends, Request

from taogate.errors import BadRequest, NotFound
from taogate.fleet.dispatcher import Dispatcher
from taogate.fleet.fleet import Fleet
from taogate.fleet.instance import Instance
from taogate.observe.history import History
from taogate.observe.status import gateway_summary, status_rows
from taogate.proxy.auth import KeyCheck, header
from taogate.settings import ConfigError, DispatchSettings
from taogate.tenancy.key_rows import key_rows
from taogate.tenancy.limiter import Limiter

log = logging.getLogger("taogate.admin")


Changes = tuple[list[str], list[str], list[str]]


def admin_router(
    fleet: Fleet,
    dispatcher: Dispatcher,
    *,
    keys: Callable[[], KeyCheck],
    reload_config: Callable[[], Changes],
    clock: Callable[[], float],
    history: History,
    dispatch: Callable[[], DispatchSettings],
    limiter: Limiter,
) -> APIRouter:
    def require_admin(request: Request) -> None:
        keys().check_admin(header(request.scope["headers"], b"authorization"))

    router = APIRouter(dependencies=[Depends(require_admin)])

    @router.get("/instances")
    async def instances() -> dict[str, Any]:
        return {
            "queued": dispatcher.queued,
            "gateway": gateway_summary(dispatcher, dispatch(), history),
            "instances": status_rows(fleet, clock()),
            "keys": key_rows(limiter),
        }

    @router.get("/keys")
    async def keys_usage() -> dict[str, Any]:
        return {"limits": limiter.summary(), "keys": key_rows(limiter)}

    @router.get("/history")
    async def frames(request: Request) -> dict[str, Any]:
        raw = request.query_params.get("since")
        try:
            since = None if raw is None else float(raw)
            if since is not None and not math.isfinite(since):
                raise ValueError(raw)
        except ValueError:
            raise BadRequest(f"since={raw!r} is not a number (a time from an earlier answer's t).") from None
        return {"now": round(clock(), 3), **history.payload(since)}

    def find(name: str) -> Instance:
        inst = fleet.find(name)
        if inst is None:
            known = ", ".join(i.name for i in fleet)
            raise NotFound(f"No instance named {name!r}; instances: {known}.", code="instance_not_found")
        return inst

    @router.post("/instances/{name}/drain")
    async def drain(name: str) -> dict[str, Any]:
        inst = find(name)
        if not inst.draining:
            inst.draining = True
            log.info("instance %s draining: no new work, %d in flight finish", name, inst.inflight)
            dispatcher.recheck()  # waiters only it could take are refused now
        return {"instance": name, "draining": True, "inflight": inst.inflight}

    @router.post("/instances/{name}/undrain")
    async def undrain(name: str) -> dict[str, Any]:
        inst = find(name)
        if inst.draining:
            inst.draining = False
            log.info("instance %s takes work again", name)
            dispatcher.pump()
        return {"instance": name, "draining": False, "inflight": inst.inflight}

    @router.post("/reload")
    async def reload() -> dict[str, Any]:
        try:
            added, removed, changed = reload_config()
        except ConfigError as exc:
            log.error("reload refused, the running config stays: %s", exc)
            raise BadRequest(
                f"Reload refused, the running config stays: {exc}", code="invalid_config"
            ) from None
        return {"added": added, "removed": removed, "changed": changed}

    return router
