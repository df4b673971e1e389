"""vLLM's informational routes, answered for the fleet (unauthenticated, as vLLM serves them).

GET  /version    ``version``: the instances' vLLM version (the lowest, when they differ: what a
                 client can count on everywhere), ``taogate``: the gateway's, ``instances``: each one's
GET  /ping       vLLM's (and SageMaker's) health check: 200 when an instance can take work, else 503
POST /ping
GET  /load       ``server_load``: requests in this gateway now, queued ones included (vLLM's own
                 count means the requests in its server, and is 0 unless it tracks them), and
                 ``instances``: each instance's own ``/load``

The instances are asked when the route is, each within a short timeout; one that does not answer
is ``null``.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable
from typing import Any

import httpx
from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response

from taogate import __version__
from taogate.fleet.fleet import Fleet
from taogate.fleet.instance import Instance

__all__ = ["info_router", "lowest_version"]

#: Seconds an instance has to answer one of these.
ASK_TIMEOUT = 2.0
_NUMBERS = re.compile(r"\d+(?:\.\d+)*")


def lowest_version(versions: list[str]) -> str | None:
    """The lowest of some version strings, by their leading numbers (``0.32.0+local`` is 0.32.0)."""

    def key(version: str) -> tuple[int, ...]:
        match = _NUMBERS.match(version)
        return tuple(int(n) for n in match.group().split(".")) if match else ()

    return min(versions, key=key) if versions else None


async def _ask(client: httpx.AsyncClient, inst: Instance, path: str) -> Any:
    key = inst.spec.api_key
    headers = {"authorization": f"Bearer {key}"} if key else None
    try:
        response = await client.get(inst.spec.url + path, headers=headers, timeout=ASK_TIMEOUT)
        return response.json() if response.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None


async def _ask_all(client: httpx.AsyncClient, fleet: Fleet, path: str, field: str) -> dict[str, Any]:
    instances = list(fleet)
    answers = await asyncio.gather(*(_ask(client, inst, path) for inst in instances))
    return {
        inst.name: answer.get(field) if isinstance(answer, dict) else None
        for inst, answer in zip(instances, answers, strict=True)
    }


def info_router(
    fleet: Fleet,
    client: Callable[[], httpx.AsyncClient],
    *,
    ready: Callable[[], bool],
    in_flight: Callable[[], int],
) -> APIRouter:
    router = APIRouter()

    @router.get("/version")
    async def version() -> JSONResponse:
        versions = await _ask_all(client(), fleet, "/version", "version")
        known = [v for v in versions.values() if isinstance(v, str)]
        return JSONResponse({"version": lowest_version(known), "taogate": __version__, "instances": versions})

    @router.api_route("/ping", methods=["GET", "POST"])
    async def ping() -> Response:
        return Response(status_code=200 if ready() else 503)

    @router.get("/load")
    async def load() -> JSONResponse:
        loads = await _ask_all(client(), fleet, "/load", "server_load")
        return JSONResponse({"server_load": in_flight(), "instances": loads})

    return router
