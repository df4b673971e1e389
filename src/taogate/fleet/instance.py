"""Live per-instance state: one ``Instance`` per configured vLLM server is the only place it lives.

Health, breaker, our in-flight work (counted by the leases, see ``lease``), the last engine scrape.
Dispatch never reads it directly: it reads a snapshot (``InstanceView``, see dispatch/types.py),
kept between dispatches until something it shows changes (``dispatch_view``; ``view`` builds one).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from taogate.dispatch.pending import Pending
from taogate.dispatch.types import EngineStats, InstanceView, Role
from taogate.fleet.breaker import Breaker
from taogate.fleet.cache_state import InstanceCache
from taogate.fleet.engine import EngineSample, engine_stats
from taogate.fleet.health import HealthState, HealthTracker
from taogate.fleet.load_report import parse_load_report
from taogate.fleet.window import RollingWindow


class PendingRequest(Protocol):
    """What an instance reads of a request still waiting for its first token (a ``Lease``)."""

    @property
    def ahead_tokens(self) -> int: ...
    @property
    def tokens(self) -> int: ...
    @property
    def sent_at(self) -> float: ...
    @property
    def stream(self) -> bool: ...
    @property
    def max_tokens(self) -> int | None: ...


#: Seconds an instance's speed bound from its pending requests is reused (see Instance.speed_bound).
BOUND_TTL = 0.005


@dataclass(frozen=True, slots=True)
class InstanceSpec:
    """What configuration says about one instance (rebuilt on reload)."""

    name: str
    url: str
    api_key: str | None = None
    role: Role = "any"
    weight: float = 1.0
    cap: int = 32
    overflow: bool = False
    priority: bool = False  # started with --scheduling-policy priority: it is told each request's class
    kv_events: str | None = None  # its KV-events endpoint (precise prefix-cache dispatch)
    kv_events_replay: str | None = None


class Instance:
    """Mutable live state of one instance; mutated only by the gateway's event loop."""

    def __init__(
        self,
        spec: InstanceSpec,
        *,
        unhealthy_after: int,
        healthy_after: int,
        breaker_failures: int,
        breaker_cooldown: float,
        breaker_max_cooldown: float | None = None,
        assume_up: bool = False,
    ) -> None:
        # The view dispatch last saw (``Fleet.views``), kept while nothing it shows has changed:
        # every write below that it shows drops it (``_changed``), and ``Fleet.views`` rebuilds it
        # when time alone moves it (``_view_ref``: the engine stats' age; the speed bound's TTL)
        # or the speed estimator has moved on (``_view_speeds``: its version).
        self._view: InstanceView | None = None
        self._view_ref = math.inf
        self._view_speeds = -1
        self.spec = spec  # replaced only through ``Fleet.apply`` (which drops every view)
        self.health = HealthTracker(
            unhealthy_after=unhealthy_after, healthy_after=healthy_after, on_move=self._health_moved
        )
        self.breaker = Breaker(
            breaker_failures, breaker_cooldown, breaker_max_cooldown, on_move=self._breaker_moved
        )
        # The overflow channel is a hosted endpoint we do not probe by default; assume it is up.
        self._assume_up = assume_up
        self._up = assume_up  # ``up``, and the breaker CLOSED: kept by their moves for the view
        self.breaker_closed = True  # ``breaker.closed``, kept by its moves (read per dispatch)
        self._models: frozenset[str] = frozenset()
        self._draining = False
        self.retired = False  # removed from the fleet (``Fleet.apply``): its answers teach no speed
        self._inflight = 0
        self._prefilling = 0
        self._prefill_tokens = 0
        self._prefill_work = 0  # expected uncached prefill of those tokens (the leases' ``work``)
        self.cache = InstanceCache()  # its prefix cache: modelled, and indexed from KV events if any
        # Leases without a first token, oldest first, each with what the speed bound reads of it
        # (its work with ours ahead, when it was sent, streamed, max_tokens): read once, at booking.
        self.pending: dict[PendingRequest, tuple[int, float, bool, int | None]] = {}
        self.engine: EngineSample | None = None
        self.engine_prev: EngineSample | None = None  # the scrape before, for counter deltas
        self._engine_stats: EngineStats | None = None  # what dispatch may use of the last scrape
        self.engine_at = 0.0  # monotonic time of the last good scrape
        self._stats_at = 0.0  # when the freshest part of _engine_stats was seen (scrape or load report)
        self._stale_after = 3.0  # the staleness rule dispatch last applied (seconds)
        self._report_raw: str | None = None  # the last load report's header, and the stats built from it
        self._report_stats: EngineStats | None = None
        self.scrape_ok = True  # last scrape succeeded (logged once per change)
        self.scrape_began: float | None = None  # a scrape is in flight since then
        self.scrape_seconds: float | None = None  # how long the last good scrape took
        self.scrape_slow = False  # it took longer than the scrape interval (logged once per change)
        self.stats_stale = False  # the last scrape is too old to trust (logged once per change)
        self.model_cards: dict[str, dict[str, Any]] = {}  # id → the instance's /v1/models entry
        self.window = RollingWindow()  # the last minute, for the side-by-side status
        self._bound = math.inf  # speed_bound over ``pending``, as of ``_bound_at``
        self._bound_at = -math.inf

    def _changed(self) -> None:
        """Something the dispatch view shows has changed: the next ``Fleet.views`` rebuilds it."""
        self._view = None

    def _health_moved(self) -> None:
        self._up = self._assume_up or self.health.state is HealthState.UP
        self._view = None

    def _breaker_moved(self) -> None:
        self.breaker_closed = self.breaker.closed
        self._view = None

    @property
    def name(self) -> str:
        return self.spec.name

    # -- what the view shows, each write dropping it -----------------------------------------------
    @property
    def models(self) -> frozenset[str]:
        return self._models

    @models.setter
    def models(self, value: frozenset[str]) -> None:
        self._models, self._view = value, None

    @property
    def draining(self) -> bool:
        return self._draining

    @draining.setter
    def draining(self, value: bool) -> None:
        self._draining, self._view = value, None

    @property
    def inflight(self) -> int:
        """Our requests sent here and not finished (the leases held)."""
        return self._inflight

    @inflight.setter
    def inflight(self, value: int) -> None:
        self._inflight, self._view = value, None

    @property
    def prefilling(self) -> int:
        """Our requests here with no first token yet."""
        return self._prefilling

    @prefilling.setter
    def prefilling(self, value: int) -> None:
        self._prefilling, self._view = value, None

    @property
    def prefill_tokens(self) -> int:
        """Their prompt tokens (the leases' ``tokens``)."""
        return self._prefill_tokens

    @prefill_tokens.setter
    def prefill_tokens(self, value: int) -> None:
        self._prefill_tokens, self._view = value, None

    @property
    def prefill_work(self) -> int:
        """Their expected uncached prefill (the leases' ``work``)."""
        return self._prefill_work

    @prefill_work.setter
    def prefill_work(self, value: int) -> None:
        self._prefill_work, self._view = value, None

    # -- leases (``lease.Lease``): one write each, not one per counter ---------------------------
    def book(self, lease: PendingRequest, tokens: int, work: int) -> int:
        """A lease taken here; returns our prefill tokens queued ahead of it."""
        ahead = self._prefill_tokens
        self._inflight += 1
        self._prefilling += 1
        self._prefill_tokens = ahead + tokens
        self._prefill_work += work
        self.pending[lease] = (ahead + tokens, lease.sent_at, lease.stream, lease.max_tokens)
        self._view = None
        return ahead

    def prefilled(self, lease: PendingRequest, tokens: int, work: int) -> None:
        """A lease's first token: its prompt no longer counts as queued prefill."""
        self._prefilling -= 1
        self._prefill_tokens -= tokens
        self._prefill_work -= work
        self.pending.pop(lease, None)
        self._view = None

    def unbook(self, lease: PendingRequest, tokens: int, work: int, prefilled: bool) -> None:
        """A lease released; ``prefilled`` False: it never had a first token (``prefilled`` too)."""
        if not prefilled:
            self._prefilling -= 1
            self._prefill_tokens -= tokens
            self._prefill_work -= work
            self.pending.pop(lease, None)
        self._inflight -= 1
        self._view = None

    @property
    def auth_headers(self) -> dict[str, str]:
        """The instance's own key, for the control plane's calls to it."""
        key = self.spec.api_key
        return {"authorization": f"Bearer {key}"} if key else {}

    @property
    def up(self) -> bool:
        return self._assume_up or self.health.state is HealthState.UP

    def available(self, now: float) -> bool:
        """Eligible for new work: healthy, breaker lets a request through, not draining."""
        return self.up and not self.draining and self.breaker.allows(now)

    def record_scrape(self, sample: EngineSample, now: float) -> None:
        self._view = None
        self.engine_prev = self.engine
        self.engine = sample
        self.engine_at = now
        self._engine_stats = engine_stats(sample, self.engine_prev, now, now, interval=1.0)  # fresh now
        self._stats_at = now
        self.cache.configure(sample.cache_config)
        prev = self.engine_prev
        if prev is not None and prev.prefix_hits is not None and sample.prefix_hits is not None:
            gained = sample.prefix_hits - prev.prefix_hits
            self.cache.counters(gained if gained >= 0 else sample.prefix_hits)  # < 0: it restarted

    def scrapes_off(self) -> None:
        """``scrape_interval`` was set to 0: what the last scrapes said is dropped, not left to age
        behind a stale flag no scrape will ever clear (a load report's stats stay)."""
        self._view = None
        self.engine = self.engine_prev = None
        if self._engine_stats is not self._report_stats:
            self._engine_stats = None
        self.scrape_ok, self.scrape_slow, self.stats_stale = True, False, False
        self.scrape_began = self.scrape_seconds = None

    def record_load_report(self, value: str | None, now: float) -> None:
        """A non-streaming answer's ``endpoint-load-metrics``: the engine's waiting requests and KV
        usage as that request ended, fresher than the last scrape. The running count (the header
        has none) stays the scrape's while that is fresh."""
        if value and value == self._report_raw and self._engine_stats is self._report_stats:
            self._stats_at = now  # the same report as the last, with no scrape since: still true now
            return
        report = parse_load_report(value)
        if report is None:
            return
        self._view = None
        base = self._engine_stats
        if base is not None and now - self.engine_at > self._stale_after:
            base = None
        waiting = report.waiting if report.waiting is not None else base.waiting if base else 0.0
        kv = report.kv_usage if report.kv_usage is not None else base.kv_usage if base else None
        running = base.running if base is not None else 0.0  # unknown: see engine_stats
        hit_rate = base.prefix_hit_rate if base is not None else None
        self._engine_stats = self._report_stats = EngineStats(waiting, running, kv, hit_rate, 0.0)
        self._report_raw = value
        self._stats_at = now

    def engine_stats(self, now: float) -> EngineStats | None:
        """The engine's stats while dispatch's staleness rule trusts them: the last scrape's, or a
        load report's waiting and KV usage. What only a scrape says (running, the hit rate) counts
        while the scrape itself is fresh; past it, running is 0, which dispatch reads as "no more
        than the gateway's own requests there" (``load.estimate`` takes the larger)."""
        stats = self._engine_stats
        if stats is None or now - self._stats_at > self._stale_after:
            return None
        if now - self.engine_at > self._stale_after and (stats.running or stats.prefix_hit_rate is not None):
            stats = self._engine_stats = EngineStats(stats.waiting, 0.0, stats.kv_usage, None, 0.0)
        return stats

    def scrape_duration(self, now: float) -> float | None:
        """The last scrape's duration, or the one in flight's so far if that is longer."""
        began, last = self.scrape_began, self.scrape_seconds
        running = None if began is None else now - began
        if running is None or (last is not None and last > running):
            return last
        return running

    def waiting(self, now: float, decode_seconds_per_token: float) -> Iterator[Pending]:
        """Our requests here still without a first token, as evidence for ``speed_bound``.

        A non-stream request's first token is only seen with its whole response, so its decode
        (``max_tokens`` × the learned pace) is allowed for; one without ``max_tokens`` says nothing.
        """
        for lease in self.pending:
            if lease.stream:
                allowance = 0.0
            elif lease.max_tokens is not None:
                allowance = lease.max_tokens * decode_seconds_per_token
            else:
                continue
            yield Pending(lease.ahead_tokens + lease.tokens, now - lease.sent_at, allowance)

    def speed_bound(self, now: float, decode_seconds_per_token: float, base_latency: float) -> float:
        """``dispatch.pending.speed_bound`` over ``waiting``, recomputed at most every ``BOUND_TTL``
        seconds: it walks every pending lease, and at high rates many decisions fall within one
        millisecond (a bound a few milliseconds old is as good)."""
        if now - self._bound_at >= BOUND_TTL:
            self._bound = self._pending_bound(now, decode_seconds_per_token, base_latency)
            self._bound_at = now
        return self._bound

    def _pending_bound(self, now: float, decode_seconds_per_token: float, base_latency: float) -> float:
        """``speed_bound(self.waiting(now, ...), base_latency)`` in one flat pass, float for float
        (a property test holds the two equal): it runs per instance at every TTL under load, over
        what ``book`` kept of each lease."""
        bound = math.inf
        for work, sent_at, stream, max_tokens in self.pending.values():
            if stream:
                allowance = 0.0
            elif max_tokens is not None:
                allowance = max_tokens * decode_seconds_per_token
            else:
                continue
            seconds = now - sent_at - base_latency - allowance
            if seconds > 0 and work > 0:
                one = work / seconds
                if one < bound:  # noqa: PLR1730 (min() is a call: this runs per pending request)
                    bound = one
        return bound

    def dispatch_view(
        self,
        now: float,
        stale_after_s: float,
        *,
        version: int,
        params: tuple[float, float, float],
        uncached_ratio: float,
        cache: bool,
    ) -> InstanceView:
        """``view`` with the speed estimator's ``params`` (lowered by ``speed_bound`` while requests
        wait here for a first token), kept as ``_view`` until it may have changed (``Fleet.views``
        reuses it while ``version`` is current and ``_view_ref`` young enough). An open or
        half-open breaker's verdict moves with time: that view is rebuilt for every dispatch.
        The same as ``view``, in one flat pass (a property test holds the two equal)."""
        speed, base, tpot = params
        if self.pending:
            if now - self._bound_at >= BOUND_TTL:
                self._bound = self._pending_bound(now, tpot, base)
                self._bound_at = now
            bound = self._bound
            if bound < speed:  # noqa: PLR1730 (as min(speed, bound), without the call)
                speed = bound
        self._stale_after = stale_after_s
        engine = stats = self._engine_stats
        if stats is None:
            ref = math.inf  # no stats: nothing to age (a scrape or a report drops the view)
        elif now - self.engine_at <= stale_after_s:
            ref = self.engine_at  # the scrape's stats, until the scrape is stale
        else:
            engine = self.engine_stats(now)
            ref = self._stats_at if engine is not None else -math.inf  # (-inf: rebuilt every time)
        closed = self.breaker_closed
        available = self._up and not self._draining and (closed or self.breaker.allows(now))
        spec = self.spec
        inflight = self._inflight
        prefilling = self._prefilling
        icache = self.cache
        shown = cache and icache.caching
        view = InstanceView(
            spec.name,
            spec.role,
            self._models,
            available,
            inflight,
            spec.cap,
            self._prefill_tokens,
            inflight - prefilling,
            prefilling,
            speed,
            base,
            tpot,
            uncached_ratio,
            engine,
            spec.overflow,
            icache if shown else None,
            self._prefill_work if shown else None,
        )
        if closed:
            self._view, self._view_ref, self._view_speeds = view, ref, version
        return view

    def view(
        self,
        now: float,
        speed: float,
        stale_after_s: float,
        *,
        base_latency: float = 0.0,
        tpot: float = 0.0,
        uncached_ratio: float = 1.0,
        cache: bool = False,
    ) -> InstanceView:
        """This instance as dispatch sees it now; the engine's stats count while younger than
        ``stale_after_s`` (``engine_stats``: built once per scrape or load report, not per view).
        With ``cache`` (prefix affinity on) the view carries the instance's cache and the work
        booked there."""
        self._stale_after = stale_after_s
        engine = self._engine_stats
        # While the last scrape is fresh, so is anything since (a load report): no rule to apply.
        if engine is not None and now - self.engine_at > stale_after_s:
            engine = self.engine_stats(now)
        spec = self.spec
        inflight = self.inflight
        prefilling = self.prefilling
        cache = cache and self.cache.caching
        # Positional, in InstanceView's field order (a test pins it): a dispatch builds one view per
        # instance, and keyword arguments cost far more (measured: benchmarks/overhead.py).
        return InstanceView(
            spec.name,
            spec.role,
            self.models,
            self.available(now),
            inflight,
            spec.cap,
            self.prefill_tokens,
            inflight - prefilling,
            prefilling,
            speed,
            base_latency,
            tpot,
            uncached_ratio,
            engine,
            spec.overflow,
            self.cache if cache else None,
            self.prefill_work if cache else None,
        )
