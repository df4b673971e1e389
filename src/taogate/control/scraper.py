"""Engine scrapes: each instance's own ``/metrics`` (waiting, running, KV usage, prefix-cache hits).

The engine's gauges count work from every gateway replica, which our in-flight counts cannot see.
A failed scrape is logged once per change; dispatch then decides on the gateway's own counts for
that instance until the metrics are back.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import httpx

from taogate.control.events import FleetEvents
from taogate.fleet.engine import ScrapeError, parse_vllm_metrics
from taogate.fleet.fleet import Fleet
from taogate.fleet.instance import Instance
from taogate.settings import Settings

__all__ = ["Scraper"]

log = logging.getLogger("taogate.health")


class Scraper:
    def __init__(
        self,
        fleet: Fleet,
        client: httpx.AsyncClient,
        settings: Callable[[], Settings],
        events: FleetEvents,
        clock: Callable[[], float],
    ) -> None:
        self._fleet = fleet
        self._client = client
        self._settings = settings
        self._events = events
        self._clock = clock

    async def scrape_all(self) -> None:
        if self._settings().dispatch.scrape_interval <= 0:
            return
        await asyncio.gather(*(self.scrape(i) for i in list(self._fleet) if not i.spec.overflow))
        self._events.check_slow()

    async def scrape(self, inst: Instance) -> None:
        timeout = self._settings().dispatch.health_timeout
        error = ""
        try:
            async with asyncio.timeout(2 * timeout):
                r = await self._client.get(
                    inst.spec.url + "/metrics", timeout=timeout, headers=inst.auth_headers
                )
            if r.status_code == 200:
                inst.record_scrape(parse_vllm_metrics(r.text), self._clock())
                if not inst.scrape_ok:
                    inst.scrape_ok = True
                    log.info("instance %s: engine metrics are back", inst.name)
                return
            error = f"/metrics answered {r.status_code}"
        except (httpx.HTTPError, OSError, TimeoutError) as exc:
            error = f"/metrics failed: {type(exc).__name__}"
        except ScrapeError as exc:
            error = f"/metrics unreadable: {exc}"
        if inst.scrape_ok:
            inst.scrape_ok = False
            log.warning(
                "instance %s: %s; dispatch goes on with the gateway's own counts for it", inst.name, error
            )
