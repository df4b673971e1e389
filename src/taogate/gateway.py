"""The gateway: builds the parts from the settings, starts and stops them, and reloads them.

Built once by ``create_app(settings)``; the ASGI lifespan calls ``start`` and ``stop``. Requests go
to ``pipeline.handle``. What lives where::

    fleet        the instances and their live state        dispatcher  the wait queue and the picks
    pipeline     one request end to end                    upstream    the proxied hop's pool
    probes       health, models, warm-up                   scraper     the engines' own /metrics
    discovery    instances from DNS                        events      state changes, logged once
    history      the last few minutes, for the fleet page
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import time
from collections.abc import Callable, Mapping

from prometheus_client import CollectorRegistry

from taogate.control.discovery import Discovery, Resolver, discovered_specs, system_resolver
from taogate.control.events import FleetEvents
from taogate.control.http import control_client, control_timeouts
from taogate.control.kv_events import KvEventsSubscriber, require_precise
from taogate.control.loops import Background
from taogate.control.probes import HealthProbes
from taogate.control.scraper import Scraper
from taogate.control.warmup import Warmup
from taogate.dispatch.policy import Policy, make_policy
from taogate.dispatch.speed import SpeedEstimator
from taogate.dispatch.token_ids import MAX_PREFIX_TOKENS, PromptTokenizer, load_prompt_tokenizer
from taogate.dispatch.tokens import TokenEstimator, TokenizerUnavailable, load_exact_counter
from taogate.fleet.dispatcher import Dispatcher
from taogate.fleet.fleet import Fleet, specs_from_settings
from taogate.fleet.instance import InstanceSpec
from taogate.observe.access_log import AccessLog
from taogate.observe.accounting import Accounting
from taogate.observe.dropped import SERVER_LOGGER, DroppedResponses
from taogate.observe.history import HISTORY_INTERVAL, History, sample
from taogate.observe.metrics import FleetCollector, GatewayMetrics
from taogate.proxy.auth import KeyCheck
from taogate.proxy.intake import Intake
from taogate.proxy.pipeline import Pipeline
from taogate.proxy.retry import RetryBudget
from taogate.proxy.upstream import Upstream
from taogate.settings import ConfigError, Settings

log = logging.getLogger("taogate.gateway")


class Gateway:
    def __init__(
        self,
        settings: Settings,
        *,
        environ: Mapping[str, str] | None = None,
        clock: Callable[[], float] = time.monotonic,
        registry: CollectorRegistry | None = None,
        rng: Callable[[], float] = random.random,
        settings_source: Callable[[], Settings] | None = None,
        resolver: Resolver = system_resolver,
        access_sink: Callable[[str], None] | None = None,
    ) -> None:
        self.settings = settings
        self.clock = clock
        self._environ = os.environ if environ is None else environ
        self._settings_source = settings_source
        self._access_sink = access_sink  # where access lines go instead of logging records (cli)
        self.discovered: list[InstanceSpec] = []  # from [discovery] dns, refreshed by discovery
        keys = KeyCheck(settings.api_key(self._environ), settings.admin_key(self._environ))
        # Learned speeds are rebuilt at most every 5 ms: at high request rates, once per response
        # would cost more than the rest of the learning.
        self.speeds = SpeedEstimator(rebuild_every=0.005, clock=clock)
        tokens = TokenEstimator(chars_per_token=settings.prefill.chars_per_token)
        # Optional exact counts for plain text; TokenizerUnavailable names what is missing.
        exact = load_exact_counter(settings.prefill.tokenizer) if settings.prefill.tokenizer else None
        require_precise(settings)
        prompt_tokenizer = self._prompt_tokenizer(settings)
        self.fleet = Fleet(settings, self.speeds)
        self.fleet.apply(settings, self._specs(settings))
        self.dispatcher = Dispatcher(
            self.fleet,
            self._make_policy(settings),
            queue_size=settings.dispatch.queue_size,
            queue_timeout=settings.dispatch.queue_timeout,
            clock=clock,
            oldest_every=settings.dispatch.oldest_every,
        )
        self.registry = registry if registry is not None else CollectorRegistry()
        self.metrics = GatewayMetrics(self.registry)
        self.registry.register(FleetCollector(self.fleet, self.dispatcher, clock))
        self.accounting = Accounting(
            self.metrics,
            self.fleet,
            tokens,
            self.speeds,
            AccessLog(settings.gateway.log_format, access_sink),
            clock,
            settings.prefill.tag,
        )
        self.events = FleetEvents(
            self.fleet,
            self.dispatcher,
            self.metrics,
            breaker_cooldown=lambda: self.settings.dispatch.breaker_cooldown,
            clock=clock,
        )
        self.upstream = Upstream(settings.gateway)
        self.client = control_client(settings.gateway)  # probes, scrapes, warm-up, admin calls
        self.dropped = DroppedResponses()  # hides the server's complaint about our deliberate drops
        self.pipeline = Pipeline(
            settings,
            keys,
            intake=Intake(settings, tokens, exact, blocks=prompt_tokenizer, scope=self._precise_scope),
            dispatcher=self.dispatcher,
            upstream=self.upstream,
            accounting=self.accounting,
            metrics=self.metrics,
            budget=RetryBudget(ratio=settings.dispatch.retry.budget_ratio, min_per_window=3, window=10.0),
            events=self.events,
            dropped=self.dropped,
            clock=clock,
            rng=rng,
        )
        current = self._current
        # precise mode: instances with kv_events, when requests' own token ids can be made
        self.kv_events = KvEventsSubscriber(self.fleet, precise=prompt_tokenizer is not None, clock=clock)
        warm_up = Warmup(self.client, self.speeds, current, ready=self.kv_events.live)
        self.probes = HealthProbes(
            self.fleet, self.client, current, self.events, warm_up=warm_up, clock=clock
        )
        self.scraper = Scraper(self.fleet, self.client, current, self.events, clock)
        self.discovery = Discovery(current, resolver, self.set_discovered, lambda: len(self.discovered))
        self.history = History()
        self._background = Background()

    def _current(self) -> Settings:
        return self.settings

    @property
    def keys(self) -> KeyCheck:
        return self.pipeline.keys

    @property
    def accepting(self) -> bool:
        return self.pipeline.accepting

    @staticmethod
    def _prompt_tokenizer(settings: Settings) -> PromptTokenizer | None:
        """The request's own token ids, for instances whose KV events are indexed (precise mode):
        needs ``[prefill] tokenizer``; without it those instances use the approximate model. Built
        whenever the tokenizer is set (it cannot change on reload, ``kv_events`` can); its packages
        are required only when an instance has ``kv_events`` now."""
        if settings.prefill.tokenizer is None:
            return None
        try:
            return load_prompt_tokenizer(settings.prefill.tokenizer, settings.prefill.chat_template)
        except TokenizerUnavailable:
            if any(i.kv_events for i in settings.instances):
                raise
            return None

    def _precise_scope(self) -> tuple[tuple[int, ...], int]:
        """What a request's hashes are needed for: the block sizes of the KV-event indexes in use,
        and the prefix worth hashing (the largest of their caches, at most ``MAX_PREFIX_TOKENS``)."""
        sizes: set[int] = set()
        largest = 0
        for inst in self.fleet:
            index = inst.cache.index
            if index is not None and index.usable:
                sizes.add(index.block_size)
                largest = max(largest, index.capacity * index.block_size)
        return tuple(sizes), min(MAX_PREFIX_TOKENS, largest)

    @staticmethod
    def _make_policy(settings: Settings) -> Policy:
        d = settings.dispatch
        return make_policy(d.strategy, affinity=d.prefix_affinity, affinity_slack=d.affinity_slack)

    # -- lifecycle ------------------------------------------------------------------------------
    async def start(self) -> None:
        logging.getLogger(SERVER_LOGGER).addFilter(self.dropped)
        # One round before serving, so a fresh gateway knows who is up and what they serve.
        await self.discovery.resolve()
        self.kv_events.sync()  # subscribed before any traffic of ours: the warm-up's blocks are indexed
        await asyncio.gather(self.probes.probe_all(), self.scraper.scrape_all())
        bg = self._background
        bg.every(lambda: self.settings.discovery.interval, self._discover)
        bg.every(lambda: self.settings.dispatch.health_check_interval, self.probes.probe_all)
        bg.every(lambda: self.settings.dispatch.scrape_interval, self.scraper.scrape_all)
        bg.every(lambda: HISTORY_INTERVAL, self._record_history)

    async def stop(self) -> None:
        """Stop taking work, give in-flight requests ``shutdown_timeout`` to finish, then close."""
        await self.pipeline.drain(self.settings.gateway.shutdown_timeout)
        await self._background.stop()
        await self.scraper.aclose()
        await self.kv_events.stop()
        await self.client.aclose()
        await self.upstream.aclose()
        logging.getLogger(SERVER_LOGGER).removeFilter(self.dropped)

    async def _record_history(self) -> None:
        self.history.add(sample(self.fleet, self.dispatcher, self.metrics, self.clock()))

    async def _discover(self) -> None:
        if await self.discovery.resolve():
            self._probe_new()

    def _probe_new(self) -> None:
        for inst in self.probes.unprobed():
            self._background.once(self.probes.probe(inst))

    # -- configuration --------------------------------------------------------------------------
    def reload_from_source(self) -> tuple[list[str], list[str], list[str]]:
        """Re-read the config files (SIGHUP, POST /admin/reload); ConfigError keeps the old config."""
        if self._settings_source is None:
            raise ConfigError("the gateway was not started from a config file; nothing to reload")
        return self.reload(self._settings_source())

    def reload(self, settings: Settings) -> tuple[list[str], list[str], list[str]]:
        """Apply a new validated config; in-flight requests keep their leases."""
        keys = KeyCheck(settings.api_key(self._environ), settings.admin_key(self._environ))
        old = self.settings
        # Another DNS name: its addresses come with the next resolution.
        discovered = self.discovered if settings.discovery.dns == old.discovery.dns else []
        specs = self._specs(settings, discovered)  # may raise ConfigError: before anything changes
        require_precise(settings)
        self.discovered = discovered
        restart_only = old.restart_only_changes(settings)
        if restart_only:
            log.warning("reload: %s take effect only after a restart", ", ".join(restart_only))
        policy_changed = old.dispatch.policy_key != settings.dispatch.policy_key
        self.settings = settings
        self.pipeline.configure(settings, keys)
        changes = self.fleet.apply(settings, specs)
        self.accounting.access = AccessLog(settings.gateway.log_format, self._access_sink)
        self.accounting.long_tag = settings.prefill.tag
        self.upstream.configure(settings.gateway)
        self.client.timeout = control_timeouts(settings.gateway)
        d = settings.dispatch
        if policy_changed:  # a rebuilt policy forgets its rotation (the caches' state is the instances')
            self.dispatcher.policy = self._make_policy(settings)
        self.dispatcher.queue_size = d.queue_size
        self.dispatcher.queue_timeout = d.queue_timeout
        self.dispatcher.oldest_every = d.oldest_every
        self.pipeline.budget.ratio = d.retry.budget_ratio
        self._probe_new()
        self.kv_events.sync()
        self.dispatcher.pump()
        added, removed, changed = changes
        for name in removed:
            self.metrics.forget_instance(name)
        log.info("config reloaded: added %s, removed %s, changed %s", added, removed, changed)
        return changes

    def _specs(self, settings: Settings, discovered: list[InstanceSpec] | None = None) -> list[InstanceSpec]:
        static = specs_from_settings(settings, self._environ)
        names = {s.name for s in static}
        found = self.discovered if discovered is None else discovered
        return static + [d for d in found if d.name not in names]

    def set_discovered(self, addresses: list[str]) -> tuple[list[str], list[str]]:
        """Install a new set of discovered addresses; returns (joined, left) instance names."""
        specs = discovered_specs(addresses, self.settings.discovery, self.settings, self._environ)
        if specs == self.discovered:
            return [], []
        self.discovered = specs
        added, removed, _ = self.fleet.apply(self.settings, self._specs(self.settings))
        for name in removed:  # pods come and go: their label sets must not pile up in /metrics
            self.metrics.forget_instance(name)
        self.kv_events.sync()
        self.dispatcher.pump()
        return added, removed
