"""Engine scrapes: each instance's own ``/metrics`` (waiting, running, KV usage, prefix-cache hits, and
the per-request phase times the speed estimator learns from).

The engine's gauges count work from every gateway replica, which our in-flight counts cannot see.
vLLM renders ``/metrics`` slowly while its engine works (seconds, under load), so one instance's slow
answer must not hold up the others': each round starts a scrape of every instance not still being
scraped, waits for them at most one interval, then judges every instance's stats. A failed scrape,
a scrape slower than the interval, and stats too old to trust (``fleet.engine.stale_after``) are each
logged once per change and shown as metrics; dispatch decides on the gateway's own counts for an
instance whose stats are stale, until a scrape answers again.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Final

from taogate import h1
from taogate.control.http import Fetcher
from taogate.control.loops import cancel_all
from taogate.fleet.engine import ScrapeError, engine_window, is_stale, parse_vllm_metrics, stale_after
from taogate.fleet.events import FleetEvents
from taogate.fleet.fleet import Fleet
from taogate.fleet.instance import Instance
from taogate.settings import Settings

__all__ = ["Scraper"]

log = logging.getLogger("taogate.health")

#: A scrape's read may take half of this (or ``health_timeout``, if longer), connect and head as
#: long again, before it is given up (vLLM has been seen to need several seconds).
SCRAPE_LIMIT: Final = 10.0
#: The largest /metrics read (vLLM's is tens of KB; labels by the hundred, LoRA adapters, make more).
METRICS_LIMIT: Final = 32 << 20


class Scraper:
    def __init__(
        self,
        fleet: Fleet,
        fetcher: Fetcher,
        settings: Callable[[], Settings],
        events: FleetEvents,
        clock: Callable[[], float],
    ) -> None:
        self._fleet = fleet
        self._fetcher = fetcher
        self._settings = settings
        self._events = events
        self._clock = clock
        self._running: dict[str, asyncio.Task[None]] = {}

    async def scrape_all(self) -> None:
        interval = self._settings().dispatch.scrape_interval
        if interval <= 0:
            return
        started = []
        for inst in list(self._fleet):
            if inst.spec.overflow or inst.name in self._running:
                continue
            task = asyncio.get_running_loop().create_task(self.scrape(inst))
            self._running[inst.name] = task
            task.add_done_callback(self._done)
            started.append(task)
        if started:
            await asyncio.wait(started, timeout=interval)
        self._judge(interval)
        self._events.check_slow()

    def _done(self, task: asyncio.Task[None]) -> None:
        for name, running in list(self._running.items()):
            if running is task:
                del self._running[name]

    async def aclose(self) -> None:
        """Cancel the scrapes still running (a round does not wait for slow ones)."""
        await cancel_all(list(self._running.values()), "scrape")

    async def scrape(self, inst: Instance) -> None:
        settings = self._settings().dispatch
        timeout = max(settings.health_timeout, SCRAPE_LIMIT / 2)
        error = ""
        began = self._clock()
        inst.scrape_began = began
        key = inst.spec.api_key
        headers = [(b"authorization", b"Bearer " + key.encode())] if key else []
        try:
            async with asyncio.timeout(2 * timeout):  # its connect and its head; the body within one
                status, body = await self._fetcher.get(
                    inst.spec.url, b"/metrics", headers, limit=METRICS_LIMIT, within=timeout
                )
            if status == 200:
                self._took(inst, self._clock() - began, settings.scrape_interval)
                self._record(inst, body.decode("utf-8", "replace"))
                return
            error = f"/metrics answered {status}"
        except ScrapeError as unreadable:
            error = f"/metrics unreadable: {unreadable}"
        except (h1.H1Error, OSError, TimeoutError, ValueError) as exc:  # ValueError: a URL h1 refuses
            error = f"/metrics failed: {type(exc).__name__}"
        finally:
            inst.scrape_began = None
        if inst.scrape_ok:
            inst.scrape_ok = False
            log.warning(
                "instance %s: %s; dispatch goes on with the gateway's own counts for it", inst.name, error
            )

    def _record(self, inst: Instance, text: str) -> None:
        if self._settings().dispatch.scrape_interval <= 0:
            return  # scrapes turned off while this one was in flight: no later one would age it out
        sample = parse_vllm_metrics(text)
        inst.record_scrape(sample, self._clock())
        if inst.engine_prev is not None and not inst.retired:  # a removed instance's speed is forgotten
            window = engine_window(inst.engine_prev, sample)
            if window is not None:
                self._fleet.speeds.observe_engine(
                    inst.name,
                    requests=window.requests,
                    prefill_seconds=window.prefill_seconds,
                    computed_tokens=window.computed_tokens,
                    prompt_tokens=window.prompt_tokens,
                    decode_seconds_per_token=window.decode_seconds_per_token,
                    queue_seconds=window.queue_seconds,
                )
            else:
                self._fleet.speeds.settle(inst.name)
        if not inst.scrape_ok:
            inst.scrape_ok = True
            log.info("instance %s: engine metrics are back", inst.name)

    @staticmethod
    def _took(inst: Instance, seconds: float, interval: float) -> None:
        inst.scrape_seconds = seconds
        slow = seconds > interval
        if slow and not inst.scrape_slow:
            log.warning(
                "instance %s: a scrape of /metrics took %.2f s, longer than the %.2f s scrape interval: "
                "its engine stats arrive late",
                inst.name,
                seconds,
                interval,
            )
        elif inst.scrape_slow and not slow:
            log.info("instance %s: /metrics answers within the scrape interval again", inst.name)
        inst.scrape_slow = slow

    def _judge(self, interval: float) -> None:
        """Say once per change when an instance's engine stats become too old for dispatch to trust."""
        now = self._clock()
        limit = stale_after(interval)
        for inst in self._fleet:
            if inst.spec.overflow or inst.engine is None:
                continue  # never scraped: nothing was trusted, the failed scrape says why
            stale = is_stale(inst.engine_at, now, interval)
            if stale and not inst.stats_stale:
                log.warning(
                    "instance %s: engine stats are %.1f s old, past the %.1f s they are trusted for; "
                    "dispatch goes on with the gateway's own counts for it (and the load reports of "
                    "its non-streamed answers, if any)",
                    inst.name,
                    now - inst.engine_at,
                    limit,
                )
            elif inst.stats_stale and not stale:
                log.info("instance %s: engine stats are fresh again", inst.name)
            inst.stats_stale = stale
