"""Background loops owned by the gateway's lifespan: health probes and engine scrapes.

Probes never block requests: they run on their own schedule, with their own short timeout, and only
publish results into each Instance. Every state change is logged once and counted, not every probe.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

import httpx
import orjson

from taogate.control.warmup import WarmupTarget, warm_up
from taogate.fleet.breaker import BreakerTransition
from taogate.fleet.engine import ScrapeError, parse_vllm_metrics
from taogate.fleet.health import HealthState, probe_result

if TYPE_CHECKING:
    from taogate.fleet.instance import Instance
    from taogate.gateway import Gateway

log = logging.getLogger("taogate.health")


class Probes:
    def __init__(self, gateway: Gateway) -> None:
        self._gw = gateway
        self._tasks: list[asyncio.Task[None]] = []
        self._oneshots: set[asyncio.Task[None]] = set()
        self._dns_ok = True

    @property
    def _client(self) -> httpx.AsyncClient:
        client = self._gw.client
        assert client is not None
        return client

    async def start(self) -> None:
        # One round before serving, so a fresh gateway knows who is up and what they serve.
        await self.discover()
        await asyncio.gather(self.probe_all(), self.scrape_all())
        self._tasks = [
            asyncio.create_task(self._loop(self.discover, lambda: self._gw.settings.discovery.interval)),
            asyncio.create_task(
                self._loop(self.probe_all, lambda: self._gw.settings.dispatch.health_check_interval)
            ),
            asyncio.create_task(
                self._loop(self.scrape_all, lambda: self._gw.settings.dispatch.scrape_interval)
            ),
        ]

    async def stop(self) -> None:
        """Cancel the loops and wait for them, cancelling again while one still runs: on Python
        3.11 a cancellation that lands as an ``asyncio.timeout`` inside a probe expires can be
        taken for that timeout and swallowed (seen: a loop that went on probing, and a shutdown
        that waited for it for ever)."""
        pending = {*self._tasks, *self._oneshots}
        for _ in range(100):  # bounded: 10 s
            if not pending:
                break
            for task in pending:
                task.cancel()
            done, pending = await asyncio.wait(pending, timeout=0.1)
            for task in done:  # retrieved, so none is reported as "never retrieved"
                if not task.cancelled() and task.exception() is not None:
                    log.error("probe task ended with %r", task.exception())
        if pending:
            log.error("%d probe tasks ignored cancellation; leaving them behind", len(pending))
        self._tasks = []
        self._oneshots.clear()

    def reconfigure(self) -> None:
        """Intervals are read at every tick; a reload only needs new instances probed soon."""
        for inst in self._gw.fleet:
            if inst.health.state is HealthState.UNKNOWN and not inst.spec.overflow:
                task = asyncio.get_running_loop().create_task(self.probe(inst))
                self._oneshots.add(task)
                task.add_done_callback(self._oneshots.discard)

    async def discover(self) -> None:
        """Re-resolve ``[discovery] dns``; a failed lookup keeps the current set (logged once)."""
        cfg = self._gw.settings.discovery
        if cfg.dns is None:
            return
        try:
            addresses = await asyncio.wait_for(self._gw.resolver(cfg.dns, cfg.port), 10)
            if self._gw.settings.discovery.dns != cfg.dns:
                return  # a reload changed the name while we were resolving the old one
        except (OSError, TimeoutError) as exc:
            if self._dns_ok:
                self._dns_ok = False
                log.warning(
                    "cannot resolve %s (%s); keeping the %d instances found before",
                    cfg.dns,
                    exc,
                    len(self._gw.discovered),
                )
            return
        if not self._dns_ok:
            self._dns_ok = True
            log.info("%s resolves again", cfg.dns)
        joined, left = self._gw.set_discovered(addresses)
        if joined or left:
            log.info("discovery %s: joined %s, left %s", cfg.dns, joined, left)
            self.reconfigure()

    @staticmethod
    async def _loop(tick: Any, interval: Any) -> None:
        while True:
            period = interval()
            if period <= 0:
                await asyncio.sleep(1.0)
                continue
            await asyncio.sleep(period)
            try:
                await tick()
            except Exception:  # a probe bug must not end probing
                log.exception("background probe round failed")
            task = asyncio.current_task()
            if task is not None and task.cancelling():  # a cancel swallowed inside the round
                raise asyncio.CancelledError

    def _headers(self, inst: Instance) -> dict[str, str]:
        return {"authorization": f"Bearer {inst.spec.api_key}"} if inst.spec.api_key else {}

    async def probe_all(self) -> None:
        await asyncio.gather(*(self.probe(i) for i in list(self._gw.fleet) if not i.spec.overflow))
        self._gw.dispatcher.pump()  # a breaker cool-down may have ended since the last round
        self.check_slow()

    def check_slow(self) -> None:
        """Run the slow-instance detector; one log line per change, not per check."""
        fleet = self._gw.fleet
        flagged, cleared = fleet.update_slow()
        for name in sorted(flagged):
            log.warning(
                "instance %s is slow: its prefill speed is %.2fx the fleet median whatever the dispatch; "
                "look inside it (AllReduce, host-device copies)",
                name,
                fleet.speeds.relative(name),
            )
            self._gw.metrics.child(self._gw.metrics.health_transitions, name, "slow", "slow").inc()
        for name in sorted(cleared):
            log.info("instance %s is no longer slow (%.2fx the median)", name, fleet.speeds.relative(name))
            self._gw.metrics.child(self._gw.metrics.health_transitions, name, "slow", "ok").inc()

    async def probe(self, inst: Instance) -> None:
        """GET /health, then /v1/models to learn (and refresh) what the instance serves."""
        timeout = self._gw.settings.dispatch.health_timeout
        ok = False
        detail = ""
        try:
            # A total bound per probe: the per-read timeouts alone let a trickling instance stall
            # the whole round (rounds gather every instance's probe).
            async with asyncio.timeout(2 * timeout):
                r = await self._client.get(
                    inst.spec.url + "/health", timeout=timeout, headers=self._headers(inst)
                )
                ok = probe_result(r.status_code)
                detail = f"/health answered {r.status_code}"
                if ok:
                    await self._learn_models(inst, limit=timeout)
        except (httpx.HTTPError, OSError, TimeoutError) as exc:
            detail = f"/health failed: {type(exc).__name__}"
        transition = inst.health.record(ok, self._gw.clock())
        if transition is None:
            return
        to = transition.to.value
        self._gw.metrics.child(self._gw.metrics.health_transitions, inst.name, "health", to).inc()
        if transition.to is HealthState.UP:
            log.info(
                "instance %s is up (%s); serving %s", inst.name, inst.spec.url, sorted(inst.models) or "?"
            )
            await self._warm_up(inst)
            self._gw.dispatcher.pump()
        else:
            log.warning("instance %s is %s: %s", inst.name, to, detail)

    async def _warm_up(self, inst: Instance) -> None:
        tokens = self._gw.settings.dispatch.warmup_tokens
        if tokens <= 0 or not inst.models:
            return
        headers = {**self._headers(inst), "x-request-tag": "taogate-warmup"}  # grep-able upstream
        target = WarmupTarget(inst.name, inst.spec.url, min(inst.models), headers)
        speed = await warm_up(
            self._client,
            self._gw.speeds,
            target,
            tokens=tokens,
            limit=self._gw.settings.gateway.request_timeout,
        )
        if speed is not None:
            log.info("instance %s warmed up: prefill ~%.0f tokens/s", inst.name, speed)

    async def _learn_models(self, inst: Instance, *, limit: float) -> None:
        try:
            r = await self._client.get(
                inst.spec.url + "/v1/models", timeout=limit, headers=self._headers(inst)
            )
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
        self._gw.fleet.set_models(inst, cards)

    async def scrape_all(self) -> None:
        if self._gw.settings.dispatch.scrape_interval <= 0:
            return
        await asyncio.gather(*(self.scrape(i) for i in list(self._gw.fleet) if not i.spec.overflow))
        self.check_slow()

    async def scrape(self, inst: Instance) -> None:
        timeout = self._gw.settings.dispatch.health_timeout
        error = ""
        try:
            async with asyncio.timeout(2 * timeout):
                r = await self._client.get(
                    inst.spec.url + "/metrics", timeout=timeout, headers=self._headers(inst)
                )
            if r.status_code == 200:
                inst.record_scrape(parse_vllm_metrics(r.text), self._gw.clock())
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

    def breaker_changed(self, inst: Instance, transition: BreakerTransition) -> None:
        to = transition.to.value
        self._gw.metrics.child(self._gw.metrics.health_transitions, inst.name, "breaker", to).inc()
        if to == "open":
            log.warning(
                "instance %s ejected for %.0fs after repeated request failures",
                inst.name,
                self._gw.settings.dispatch.breaker_cooldown,
            )
            loop = asyncio.get_running_loop()
            loop.call_later(self._gw.settings.dispatch.breaker_cooldown + 0.01, self._gw.dispatcher.pump)
        else:
            log.info("instance %s breaker %s", inst.name, to)
            self._gw.dispatcher.pump()
