"""The gateway: builds the parts from the settings, starts and stops them, and reloads them.

Built once by ``create_app(settings)``; the ASGI lifespan calls ``start`` and ``stop``. Requests go
to ``pipeline.handle``. A config builds its ``Parts`` (the pipeline, the queue's rules, the hop's
limits, the control plane's timeouts), swapped in whole at one place on a reload; the state that
outlives a config stays here and is carried into them by name (``_build``). What lives where::

    fleet        the instances and their live state        dispatcher  the wait queue and the picks
    pipeline     one request end to end                    upstream    the proxied hop's pool
    probes       health, models, warm-up                   scraper     the engines' own /metrics
    discovery    instances from DNS                        events      state changes, logged once
    history      the last few minutes, for the fleet page
    limiter      the client keys' limits (tenancy)
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import httpx
from prometheus_client import CollectorRegistry

from taogate import h1
from taogate.control.discovery import Discovery, Resolver, discovered_specs, system_resolver
from taogate.control.http import Fetcher, control_client, control_timeouts, fetch_limits
from taogate.control.kv_endpoints import require_precise
from taogate.control.kv_events import KvEventsSubscriber
from taogate.control.loops import Background
from taogate.control.probes import HealthProbes
from taogate.control.remeasure import Remeasure
from taogate.control.scraper import Scraper
from taogate.control.warmup import Warmup
from taogate.dispatch.calibration import TokenEstimator
from taogate.dispatch.policy import Policy, make_policy
from taogate.dispatch.speed import SpeedEstimator
from taogate.dispatch.token_ids import MAX_PREFIX_TOKENS, PromptTokenizer, load_prompt_tokenizer
from taogate.dispatch.tokens import TokenizerUnavailable, load_exact_counter
from taogate.fleet.dispatcher import Dispatcher, QueueRules
from taogate.fleet.events import FleetEvents
from taogate.fleet.fleet import Fleet, specs_from_settings
from taogate.fleet.instance import InstanceSpec
from taogate.instance_settings import server_of
from taogate.observe.access_log import AccessLog
from taogate.observe.accounting import Accounting
from taogate.observe.collectors import FleetCollector, KeysCollector, UpstreamCollector
from taogate.observe.dropped import SERVER_LOGGER, DroppedResponses
from taogate.observe.history import HISTORY_INTERVAL, History, sample
from taogate.observe.metrics import GatewayMetrics
from taogate.proxy.auth import KeyCheck
from taogate.proxy.intake import Intake
from taogate.proxy.pipeline import InFlight, Pipeline
from taogate.proxy.responses import ResponseIds
from taogate.proxy.retry import RetryBudget
from taogate.proxy.upstream import Upstream, hop_limits
from taogate.settings import ConfigError, Settings
from taogate.tenancy.keys import KeyTable
from taogate.tenancy.limiter import Limiter
from taogate.tenancy.store import LEASE_RENEW_S, RedisStore

log = logging.getLogger("taogate.gateway")


@dataclass(frozen=True, slots=True)
class Parts:
    """What one config builds (``Gateway._build``), swapped in whole by ``Gateway._install``."""

    settings: Settings
    keys: KeyCheck  # the client keys, their limits and weights
    specs: list[InstanceSpec]  # the instances it names, with those discovery found
    rules: QueueRules  # the dispatch policy and the queue's bounds
    hop: h1.Limits  # the proxied hop's timeouts and bounds
    control: httpx.Timeout  # the control plane's timeouts
    fetch: h1.Limits  # the engine scrapes' connect timeout and reply-head bounds
    pipeline: Pipeline  # keys, intake, accounting, retry budget: the requests from now on


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
        self._addresses: list[str] = []  # what [discovery] dns resolved to last
        # What outlives a config (a reload carries each into the new parts by name): learned speeds
        # and characters per token, the instances (leases in flight, KV-event indexes, breakers,
        # cache models and the prompt chains sent to each), the wait queue, the pool's
        # connections, the control plane's clients, the response ids clients chose, the requests in
        # flight, the metrics, history and discovery.
        keys = self._keys(settings)
        # Learned speeds are rebuilt at most every 5 ms: at high request rates, once per response
        # would cost more than the rest of the learning.
        self.speeds = SpeedEstimator(rebuild_every=0.005, clock=clock)
        self.tokens = TokenEstimator(chars_per_token=settings.prefill.chars_per_token)
        # Optional exact counts for plain text; TokenizerUnavailable names what is missing. The
        # tokenizer is the process's: a reload cannot change it.
        self._exact = load_exact_counter(settings.prefill.tokenizer) if settings.prefill.tokenizer else None
        require_precise(settings)
        self._prompt_tokenizer = self._load_prompt_tokenizer(settings)
        self.fleet = Fleet(settings, self.speeds)
        self.dispatcher = Dispatcher(
            self.fleet,
            self._make_policy(settings),
            queue_size=settings.dispatch.queue_size,
            queue_timeout=settings.dispatch.queue_timeout,
            clock=clock,
            oldest_every=settings.dispatch.oldest_every,
        )
        self.dispatcher.fair.configure({t.name: t.weight for t in keys.table})
        store = settings.limits.store
        self.limiter = Limiter(
            keys.table,
            settings.limits,
            clock=clock,
            fair=self.dispatcher.fair,
            store=RedisStore(store, settings.limits.store_timeout) if store else None,
        )
        self.registry = registry if registry is not None else CollectorRegistry()
        self.metrics = GatewayMetrics(self.registry)
        self.registry.register(FleetCollector(self.fleet, self.dispatcher, clock))
        self.registry.register(KeysCollector(self.limiter))
        self.events = FleetEvents(
            self.fleet,
            self.dispatcher,
            self.metrics,
            clock=clock,
        )
        self.upstream = Upstream(settings.gateway)
        self.registry.register(UpstreamCollector(self.upstream.pool))
        self.client = control_client(settings.gateway)  # probes, warm-up, admin calls
        self.fetcher = Fetcher(settings.gateway)  # engine scrapes
        self.dropped = DroppedResponses()  # hides the server's complaint about our deliberate drops
        self.responses = ResponseIds(clock)
        self.inflight = InFlight()
        self._rng = rng
        self._install(self._build(settings, self._specs(settings), None))
        current = self._current
        # precise mode: instances with kv_events, when requests' own token ids can be made
        self.kv_events = KvEventsSubscriber(
            self.fleet, precise=self._prompt_tokenizer is not None, clock=clock
        )
        warm_up = Warmup(self.client, self.speeds, current, ready=self.kv_events.live)
        self.probes = HealthProbes(
            self.fleet, self.client, current, self.events, warm_up=warm_up, clock=clock
        )
        self.remeasure = Remeasure(self.fleet, warm_up.measure, current, self.events, clock=clock)
        self.scraper = Scraper(self.fleet, self.fetcher, current, self.events, clock)
        self.discovery = Discovery(current, resolver, self.set_discovered, lambda: len(self.discovered))
        self.history = History()
        self._background = Background()

    def _current(self) -> Settings:
        return self.settings

    def _keys(self, settings: Settings) -> KeyCheck:
        """The client keys of ``settings``: ConfigError names one whose env var is unset."""
        unified = settings.api_key(self._environ)
        table = KeyTable.from_settings(settings, self._environ, unified)
        return KeyCheck(unified, settings.admin_key(self._environ), table)

    @property
    def keys(self) -> KeyCheck:
        return self.pipeline.keys

    @property
    def accounting(self) -> Accounting:
        return self.pipeline.accounting

    @property
    def accepting(self) -> bool:
        return self.pipeline.accepting

    @staticmethod
    def _load_prompt_tokenizer(settings: Settings) -> PromptTokenizer | None:
        """The request's own token ids, for instances whose KV events are indexed (precise mode):
        needs ``[prefill] tokenizer``; without it those instances use the approximate model. Built
        whenever the tokenizer is set (it cannot change on reload, ``kv_events`` can); its packages
        are required only when an instance has ``kv_events`` now."""
        if settings.prefill.tokenizer is None:
            return None
        try:
            return load_prompt_tokenizer(settings.prefill.tokenizer, settings.prefill.chat_template)
        except TokenizerUnavailable:
            if settings.kv_events:
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
        # Dispatch knows each instance's speed before the first request, unless its engine is too
        # busy with its own work to answer the warm-up soon (a gateway restarted under load).
        wait = self.settings.dispatch.warmup_wait
        if late := await self.probes.warmed(within=wait):
            log.warning(
                "serving before the warm-up of %s ended (%g s; its engine busy or slow): its speed is "
                "learned when the warm-up ends, or from traffic",
                ", ".join(late),
                wait,
            )
        bg = self._background
        bg.every(lambda: self.settings.discovery.interval, self._discover)
        bg.every(lambda: self.settings.dispatch.health_check_interval, self.probes.probe_all)
        bg.every(lambda: self.settings.dispatch.health_check_interval, self.remeasure)
        bg.every(lambda: self.settings.dispatch.scrape_interval, self.scraper.scrape_all)
        bg.every(lambda: HISTORY_INTERVAL, self._record_history)
        bg.every(lambda: LEASE_RENEW_S, self.limiter.renew)  # the shared max_concurrency's leases

    async def stop(self) -> None:
        """Stop taking work, give in-flight requests ``shutdown_timeout`` to finish, then close."""
        await self.pipeline.drain(self.settings.gateway.shutdown_timeout)
        await self._background.stop()
        await self.probes.aclose()
        await self.scraper.aclose()
        await self.kv_events.stop()
        await self.client.aclose()
        await self.fetcher.aclose()
        await self.upstream.aclose()
        await self.limiter.aclose()
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
        """Apply a new validated config: its parts are built first (a ConfigError changes nothing),
        then swapped in at one place. In-flight requests finish on the parts they started with."""
        old = self.settings
        # The addresses last resolved, as the new [discovery] section makes them instances (its
        # port, role, key, the cap); another DNS name: its addresses come with the next resolution.
        addresses = self._addresses if settings.discovery.dns == old.discovery.dns else []
        discovered = discovered_specs(addresses, settings.discovery, settings, self._environ)
        specs = self._specs(settings, discovered)  # may raise ConfigError: before anything changes
        require_precise(settings)
        parts = self._build(settings, specs, self.pipeline)
        restart_only = old.restart_only_changes(settings)
        if restart_only:
            log.warning("reload: %s take effect only after a restart", ", ".join(restart_only))
        self.discovered, self._addresses = discovered, addresses
        changes = self._install(parts)
        self._probe_new()
        self.kv_events.sync()
        self.dispatcher.recheck()
        added, removed, changed = changes
        for name in removed:
            self.metrics.forget_instance(name)
        log.info("config reloaded: added %s, removed %s, changed %s", added, removed, changed)
        return changes

    def _build(self, settings: Settings, specs: list[InstanceSpec], previous: Pipeline | None) -> Parts:
        """Everything ``settings`` decides, built new. What outlives a config comes in by name: from
        ``previous`` the learning of the access accounting and the retry budget's window, and the
        policy itself while its kind is unchanged (a rebuilt one forgets its rotation)."""
        d, g = settings.dispatch, settings.gateway
        keys = self._keys(settings)
        access = AccessLog(g.log_format, self._access_sink)
        if previous is None:
            accounting = Accounting(
                self.metrics, self.fleet, self.tokens, self.speeds, access, self.clock, settings.prefill.tag
            )
            budget = RetryBudget(ratio=d.retry.budget_ratio, min_per_window=3, window=10.0)
        else:
            accounting = previous.accounting.reloaded(access, settings.prefill.tag)
            budget = previous.budget.reloaded(d.retry.budget_ratio)
        policy = self.dispatcher.policy
        if previous is not None and previous.settings.dispatch.policy_key != d.policy_key:
            policy = self._make_policy(settings)
        pipeline = Pipeline(
            settings,
            keys,
            intake=Intake(
                settings,
                self.tokens,
                self._exact,
                blocks=self._prompt_tokenizer,
                scope=self._precise_scope,
            ),
            dispatcher=self.dispatcher,
            limiter=self.limiter,
            upstream=self.upstream,
            accounting=accounting,
            metrics=self.metrics,
            budget=budget,
            events=self.events,
            dropped=self.dropped,
            clock=self.clock,
            rng=self._rng,
            responses=self.responses,
            inflight=self.inflight,
        )
        return Parts(
            settings,
            keys,
            specs,
            QueueRules(policy, d.queue_size, d.queue_timeout, d.oldest_every),
            hop_limits(g),
            control_timeouts(g),
            fetch_limits(g),
            pipeline,
        )

    def _install(self, parts: Parts) -> tuple[list[str], list[str], list[str]]:
        """The one place a config takes effect: the new pipeline serves the requests from now on,
        and each owner of kept state takes its new rules. Returns the fleet's changes."""
        self.settings = parts.settings
        self.pipeline = parts.pipeline
        table = parts.keys.table
        self.limiter.configure(table, parts.settings.limits)  # added and revoked keys, at once
        self.dispatcher.fair.configure({t.name: t.weight for t in table})
        self.dispatcher.rules = parts.rules
        self.upstream.limits = parts.hop
        self.client.timeout = parts.control
        self.fetcher.limits = parts.fetch
        return self.fleet.apply(parts.settings, parts.specs)

    def _specs(self, settings: Settings, discovered: list[InstanceSpec] | None = None) -> list[InstanceSpec]:
        static = specs_from_settings(settings, self._environ)
        names = {s.name for s in static}
        servers = {server_of(s.url) for s in static}  # a listed server found by DNS too is listed once
        found = self.discovered if discovered is None else discovered
        return static + [d for d in found if d.name not in names and server_of(d.url) not in servers]

    def set_discovered(self, addresses: list[str]) -> tuple[list[str], list[str]]:
        """Install a new set of discovered addresses; returns (joined, left) instance names."""
        self._addresses = addresses
        specs = discovered_specs(addresses, self.settings.discovery, self.settings, self._environ)
        if specs == self.discovered:
            return [], []
        self.discovered = specs
        added, removed, _ = self.fleet.apply(self.settings, self._specs(self.settings))
        for name in removed:  # pods come and go: their label sets must not pile up in /metrics
            self.metrics.forget_instance(name)
        self.kv_events.sync()
        self.dispatcher.recheck()
        return added, removed


def start_problems(settings: Settings, environ: Mapping[str, str]) -> list[str]:
    """What would stop a gateway starting with ``settings`` that the files alone do not show: keys
    the environment must hold, the packages precise mode needs (``check-config`` says them)."""
    checks: list[Callable[[], object]] = [
        lambda: settings.api_key(environ),
        lambda: KeyTable.from_settings(settings, environ, environ.get(settings.gateway.api_key_env) or "-"),
        lambda: require_precise(settings),
    ]
    if settings.gateway.admin_key_env is not None:
        checks.append(lambda: settings.admin_key(environ))
    problems = []
    for check in checks:
        try:
            check()
        except ConfigError as exc:
            problems.append(str(exc))
    return problems
