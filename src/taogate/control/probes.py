"""Health probes: ``GET /health`` (then ``/v1/models``) of every instance, on their own schedule.

Probes never block requests: they have their own short timeout and only publish results into each
Instance. A state change goes to the fleet events (logged and counted once); an instance that comes
up is warmed up before the queue is woken for it, in a task of its own, so a slow warm-up holds up
no round of probes (startup waits a bounded time for the first ones: ``warmed``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import httpx
import orjson

from taogate.control.loops import cancel_all
from taogate.fleet.events import FleetEvents
from taogate.fleet.fleet import Fleet
from taogate.fleet.health import HealthState, probe_result
from taogate.fleet.instance import Instance
from taogate.settings import Settings

__all__ = ["HealthProbes"]

log = logging.getLogger("taogate.health")


class HealthProbes:
    def __init__(
        self,
        fleet: Fleet,
        client: httpx.AsyncClient,
        settings: Callable[[], Settings],
        events: FleetEvents,
        *,
        warm_up: Callable[[Instance], Awaitable[None]],
        clock: Callable[[], float],
    ) -> None:
        self._fleet = fleet
        self._client = client
        self._settings = settings
        self._events = events
        self._warm_up = warm_up
        self._clock = clock
        # One at a time each, by the object: a name reloaded onto another server is a new one to warm.
        self._warming: dict[Instance, asyncio.Task[None]] = {}

    async def probe_all(self) -> None:
        await asyncio.gather(*(self.probe(i) for i in list(self._fleet) if not i.spec.overflow))
        self._events.capacity_changed()  # a breaker cool-down may have ended since the last round
        self._events.check_slow()

    async def warmed(self, within: float) -> list[str]:
        """Wait, ``within`` seconds at most, for the warm-ups started so far to end; the names of
        those still running (they go on, and teach dispatch when they end)."""
        running = dict(self._warming)
        if running:
            await asyncio.wait(running.values(), timeout=within)
        return sorted({inst.name for inst, task in running.items() if not task.done()})

    async def aclose(self) -> None:
        """Cancel the warm-ups still running, and wait for them to end."""
        await cancel_all(list(self._warming.values()), "warm-up")

    def unprobed(self) -> list[Instance]:
        """Instances added since the last round (reload, discovery): they should be probed soon."""
        return [i for i in self._fleet if i.health.state is HealthState.UNKNOWN and not i.spec.overflow]

    async def probe(self, inst: Instance) -> None:
        """GET /health, then /v1/models to learn (and refresh) what the instance serves."""
        timeout = self._settings().dispatch.health_timeout
        ok = False
        detail = ""
        try:
            # A total bound per probe: the per-read timeouts alone let a trickling instance stall
            # the whole round (rounds gather every instance's probe).
            async with asyncio.timeout(2 * timeout):
                r = await self._client.get(
                    inst.spec.url + "/health", timeout=timeout, headers=inst.auth_headers
                )
                ok = probe_result(r.status_code)
                detail = f"/health answered {r.status_code}"
                if ok:
                    await self._learn_models(inst, limit=timeout)
        except (httpx.HTTPError, OSError, TimeoutError) as exc:
            detail = f"/health failed: {type(exc).__name__}"
        transition = inst.health.record(ok, self._clock())
        if transition is None:
            return
        self._events.health_changed(inst, transition, detail)
        if transition.to is HealthState.UP and inst not in self._warming:
            task = asyncio.create_task(self._warm(inst))
            self._warming[inst] = task
            task.add_done_callback(lambda done: self._ended(inst, done))

    async def _warm(self, inst: Instance) -> None:
        try:
            await self._warm_up(inst)
        except Exception:  # a bug of ours: said, and the instance serves unwarmed
            log.exception("instance %s: warm-up failed", inst.name)
        self._events.capacity_changed()
        self._events.check_slow()  # what the warm-up taught may flag a slow card now, not a round later

    def _ended(self, inst: Instance, task: asyncio.Task[None]) -> None:
        if self._warming.get(inst) is task:
            del self._warming[inst]

    async def _learn_models(self, inst: Instance, *, limit: float) -> None:
        try:
            r = await self._client.get(inst.spec.url + "/v1/models", timeout=limit, headers=inst.auth_headers)
            if r.status_code != 200:
                return
            data = orjson.loads(r.content).get("data")
        except (httpx.HTTPError, OSError, orjson.JSONDecodeError, AttributeError):
            return
        if not isinstance(data, list):
            return
        cards = {m["id"]: m for m in data if isinstance(m, dict) and isinstance(m.get("id"), str)}
        if cards and set(cards) != set(inst.models):
            log.info("instance %s serves %s", inst.name, ", ".join(sorted(cards)))
        self._fleet.set_models(inst, cards)
