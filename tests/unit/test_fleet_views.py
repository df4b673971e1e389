"""The views dispatch keeps between requests equal the views built afresh, whatever happened since.

Two fleets live through the same random events (dispatches, first tokens, releases, probes, breaker
verdicts, scrapes, load reports, speed samples, drains, models, reloads, time passing); one keeps
its instances' views (``Fleet.views``), the other builds every view afresh for each dispatch as a
snapshot did before views were kept (``reference_views``: ``Instance.view`` per instance, the
speed bound over ``Instance.waiting``). Their views and their decisions must be equal.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from taogate.dispatch.pending import speed_bound
from taogate.dispatch.policy import make_policy
from taogate.dispatch.speed import SpeedEstimator
from taogate.dispatch.types import InstanceView, RequestFacts
from taogate.fleet.dispatcher import Dispatcher
from taogate.fleet.engine import CacheConfig, EngineSample, stale_after
from taogate.fleet.fleet import Fleet, specs_from_settings
from taogate.fleet.instance import BOUND_TTL
from taogate.fleet.lease import Lease
from taogate.instance_settings import InstanceSettings
from taogate.settings import DispatchSettings, Settings

NAMES = ("a", "b", "c")


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _settings(cap: int, scrape: float, affinity: bool, names: tuple[str, ...] = NAMES) -> Settings:
    return Settings(
        instances=[
            InstanceSettings(url=f"http://127.0.0.1:{9000 + i}", name=n, max_queue=cap)
            for i, n in enumerate(names)
        ],
        dispatch=DispatchSettings(scrape_interval=scrape, prefix_affinity=affinity),
    )


def reference_views(fleet: Fleet, settings: Settings, now: float) -> list[InstanceView]:
    """Every instance's view built afresh, as ``Fleet.views`` did before it kept them."""
    speeds = fleet.speeds
    stale = stale_after(settings.dispatch.scrape_interval)
    out = []
    for inst in fleet:
        name = inst.spec.name
        speed, base, tpot = speeds.params(name)
        if inst.pending:
            if now - inst._bound_at >= BOUND_TTL:
                inst._bound = speed_bound(inst.waiting(now, tpot), base)
                inst._bound_at = now
            speed = min(speed, inst._bound)
        view = inst.view(
            now,
            speed,
            stale,
            base_latency=base,
            tpot=tpot,
            uncached_ratio=speeds.uncached_ratio(name),
            cache=settings.dispatch.prefix_affinity,
        )
        out.append(view)
    return out


class Side:
    """One fleet and its dispatcher; ``fresh``: its views are ``reference_views``."""

    def __init__(self, clock: Clock, fresh: bool) -> None:
        self.clock = clock
        self.fresh = fresh
        self.settings = s = _settings(4, 1.0, True)
        self.speeds = SpeedEstimator(rebuild_every=0.005, clock=clock)
        self.fleet = Fleet(s, self.speeds)
        self.fleet.apply(s, specs_from_settings(s, {}))
        if fresh:
            self.fleet.views = lambda now: reference_views(self.fleet, self.settings, now)  # type: ignore[method-assign]
        self.dispatcher = Dispatcher(
            self.fleet, make_policy("least_busy", affinity=True), queue_size=8, queue_timeout=1.0, clock=clock
        )
        self.leases: list[Lease] = []

    def views(self) -> list[InstanceView]:
        return self.fleet.views(self.clock())

    def apply(self, event: tuple[Any, ...]) -> object:
        kind, i, x = event
        fleet, now = self.fleet, self.clock()
        insts = list(fleet)
        inst = insts[i % len(insts)] if insts else None
        if kind == "dispatch":
            facts = RequestFacts(
                "m" if x % 3 else None,
                1 + x * 37 % 3000,
                x % 5 == 0,
                prefix_key=x % 4 if x % 2 else None,
                prefix_tokens=512 if x % 2 else 0,
                stream=x % 3 == 0,
                max_tokens=None if x % 7 == 0 else 1 + x % 64,
            )
            try:
                got = self.dispatcher.try_acquire(facts)
            except Exception as exc:  # refusals: the same on both sides
                return type(exc).__name__
            if got is None:
                return None
            self.leases.append(got[0])
            return (got[0].instance.name, got[1])
        if kind in ("first", "release"):
            if not self.leases:
                return None
            lease = self.leases[x % len(self.leases)]
            if kind == "first":
                lease.first_token()
            else:
                lease.release()
                self.leases.remove(lease)
            return None
        if inst is None:
            return None
        if kind == "probe":
            return inst.health.record(x % 3 != 0, now)
        if kind == "verdict":
            ok = x % 2 == 0
            return inst.breaker.record_success(now) if ok else inst.breaker.record_failure(now)
        if kind == "scrape":
            config = CacheConfig(block_size=16, num_gpu_blocks=64 + x % 3, prefix_caching=x % 5 != 0)
            sample = EngineSample(
                running=float(x % 4), waiting=float(x % 3), kv_usage=(x % 10) / 10, cache_config=config
            )
            inst.record_scrape(sample, now)
        elif kind == "report":
            inst.record_load_report(
                f'JSON {{"named_metrics": {{"num_requests_waiting": {x % 3}, "kv_cache_usage_perc": 0.5}}}}',
                now,
            )
        elif kind == "engine_stats":
            return inst.engine_stats(now)
        elif kind == "learn":
            self.speeds.observe_first_token(
                inst.name,
                ttft=0.01 + x / 1000,
                ahead_tokens=x % 500,
                uncached_tokens=x % 300 or None,
                prompt_tokens=300,
            )
        elif kind == "window":
            self.speeds.observe_engine(
                inst.name,
                requests=1 + x % 4,
                prefill_seconds=0.05,
                computed_tokens=100 + x,
                prompt_tokens=400,
            )
        elif kind == "drain":
            inst.draining = not inst.draining
        elif kind == "models":
            fleet.set_models(inst, {"m": {}} if x % 2 else {"other": {}})
        elif kind == "reload":
            names = NAMES if x % 4 else NAMES[:2]
            self.settings = s = _settings(2 + x % 5, (0.5, 1.0, 0.0)[x % 3], x % 2 == 0, names)
            fleet.apply(s, specs_from_settings(s, {}))
        return None


EVENTS = st.tuples(
    st.sampled_from(
        [
            "dispatch",
            "dispatch",
            "dispatch",
            "first",
            "release",
            "release",
            "probe",
            "verdict",
            "scrape",
            "report",
            "engine_stats",
            "learn",
            "window",
            "drain",
            "models",
            "reload",
            "tick",
        ]
    ),
    st.integers(0, 5),
    st.integers(0, 10_000),
)
TICKS = st.sampled_from([0.0, 0.0005, 0.001, 0.004, 0.005, 0.006, 0.1, 1.0, 2.9, 3.0, 3.1, 20.0])


def _shown(view: InstanceView) -> tuple[object, ...]:
    """A view's fields, its cache as whether one is shown (each fleet has its own objects)."""
    fields = dataclasses.astuple(dataclasses.replace(view, cache=None))
    return (*fields, view.cache is None)


@pytest.mark.python_only  # sets a method on the fleet, which a compiled class does not allow
@settings(max_examples=300, deadline=None)
@given(events=st.lists(st.tuples(EVENTS, TICKS), max_size=80))
def test_kept_views_equal_fresh_ones(events: list[tuple[tuple[Any, ...], float]]) -> None:
    clock = Clock()
    kept, fresh = Side(clock, fresh=False), Side(clock, fresh=True)
    for inst_k, inst_f in zip(kept.fleet, fresh.fleet, strict=True):
        inst_k.health.record(True, clock.now)
        inst_f.health.record(True, clock.now)
    for event, tick in events:
        clock.now += tick
        if event[0] == "tick":
            continue
        assert kept.apply(event) == fresh.apply(event)
        assert [_shown(v) for v in kept.views()] == [_shown(v) for v in fresh.views()]


def test_a_kept_view_is_a_new_object_after_a_change() -> None:
    """Views handed out earlier are never changed in place: a change builds a new one."""
    clock = Clock()
    side = Side(clock, fresh=False)
    for inst in side.fleet:
        inst.health.record(True, clock.now)
    before = side.fleet.views(clock.now)
    assert side.fleet.views(clock.now) == before
    got = side.dispatcher.try_acquire(RequestFacts(None, 10, False))
    assert got is not None
    after = side.fleet.views(clock.now)
    changed = [b for b, a in zip(before, after, strict=True) if a is not b]
    assert [v.name for v in changed] == [got[0].instance.name]
    assert changed[0].inflight == 0


def test_an_open_breaker_s_view_follows_the_clock() -> None:
    clock = Clock()
    side = Side(clock, fresh=False)
    inst = next(iter(side.fleet))
    inst.health.record(True, clock.now)
    for _ in range(5):
        inst.breaker.record_failure(clock.now)
    assert not side.fleet.views(clock.now)[0].available
    clock.now += 15.0  # the cooldown: a trial may go
    assert side.fleet.views(clock.now)[0].available


def test_views_cost_no_rebuild_while_nothing_changes() -> None:
    clock = Clock()
    side = Side(clock, fresh=False)
    for inst in side.fleet:
        inst.health.record(True, clock.now)
    first = side.fleet.views(clock.now)
    started = time.perf_counter()
    again = side.fleet.views(clock.now + 0.001)
    assert time.perf_counter() - started < 1.0
    assert all(a is b for a, b in zip(first, again, strict=True))


def test_a_weight_changed_by_reload_prices_the_instance_at_once() -> None:
    """The weight an instance is priced at before it has samples follows the config on reload."""
    settings = _settings(4, 1.0, True, names=("a", "b"))
    speeds = SpeedEstimator()
    fleet = Fleet(settings, speeds)
    fleet.apply(settings, specs_from_settings(settings, {}))
    assert speeds.speed("b") == speeds.speed("a")
    heavier = settings.model_copy(
        update={
            "instances": [settings.instances[0], settings.instances[1].model_copy(update={"weight": 2.0})]
        }
    )
    _, _, changed = fleet.apply(heavier, specs_from_settings(heavier, {}))
    assert changed == ["b"] and speeds.speed("b") == pytest.approx(2 * speeds.speed("a"))


def test_the_breaker_rests_longer_after_each_failed_trial_up_to_the_configured_most() -> None:
    """``breaker_cooldown`` doubles per failed trial up to ``breaker_max_cooldown``, as configured."""
    settings = _settings(4, 1.0, True, names=("a",)).model_copy(
        update={
            "dispatch": DispatchSettings(breaker_failures=1, breaker_cooldown=2.0, breaker_max_cooldown=5.0)
        }
    )
    fleet = Fleet(settings, SpeedEstimator())
    fleet.apply(settings, specs_from_settings(settings, {}))
    breaker, now, rests = fleet.get("a").breaker, 0.0, []
    opened = breaker.record_failure(now)
    for _ in range(3):
        assert opened is not None
        rests.append(opened.cooldown)
        now += opened.cooldown
        assert breaker.on_dispatch(now)  # the trial
        opened = breaker.record_failure(now)
    assert rests == [2.0, 4.0, 5.0]


def test_scrapes_turned_off_by_reload_leave_no_stats_to_age() -> None:
    """With ``scrape_interval = 0`` no scrape would ever clear a stale flag or replace the last
    stats: a reload that turns scrapes off drops them, and the flags with them."""
    settings = _settings(4, 1.0, True, names=("a",))
    fleet = Fleet(settings, SpeedEstimator())
    fleet.apply(settings, specs_from_settings(settings, {}))
    inst = fleet.get("a")
    inst.record_scrape(EngineSample(prompt_tokens=10.0, generation_tokens=5.0, kv_usage=0.5, engines=1), 1.0)
    inst.stats_stale = inst.scrape_slow = True
    assert inst.engine is not None
    off = settings.model_copy(update={"dispatch": DispatchSettings(scrape_interval=0)})
    fleet.apply(off, specs_from_settings(off, {}))
    assert inst.engine is None and inst.engine_stats(1.5) is None
    assert not inst.stats_stale and not inst.scrape_slow


def test_an_instance_removed_and_listed_again_while_busy_keeps_its_cap() -> None:
    """A pod that drops out of discovery and comes back while its requests run is the same
    instance: its cap counts those requests, not a fresh zero."""
    settings = _settings(1, 1.0, True, names=("a", "b"))
    fleet = Fleet(settings, SpeedEstimator())
    specs = specs_from_settings(settings, {})
    fleet.apply(settings, specs)
    d = Dispatcher(fleet, make_policy("least_busy"), queue_size=4, queue_timeout=1.0, clock=lambda: 1.0)
    for inst in fleet:
        inst.health.record(True, 0.0)
    facts = RequestFacts(model=None, prompt_tokens=10, long=False)
    held = [d.try_acquire(facts), d.try_acquire(facts)]
    assert {h[1].instance for h in held if h is not None} == {"a", "b"}
    only_a = [s for s in specs if s.name == "a"]
    _, removed, _ = fleet.apply(settings, only_a)
    assert removed == ["b"]
    added, _, _ = fleet.apply(settings, specs)
    assert added == ["b"] and fleet.get("b").inflight == 1 and not fleet.get("b").retired
    assert d.try_acquire(facts) is None  # both at their cap of 1: the request waits
    for h in held:
        assert h is not None
        h[0].release()
    assert fleet.all_inflight() == 0


def test_an_instance_pointed_at_another_url_by_reload_starts_afresh() -> None:
    """A name that now names another server keeps nothing of the old one's: its health is probed
    again, its speed learned again; the old one's request finishes where it runs."""
    settings = _settings(2, 1.0, True, names=("a",))
    speeds = SpeedEstimator()
    fleet = Fleet(settings, speeds)
    fleet.apply(settings, specs_from_settings(settings, {}))
    d = Dispatcher(fleet, make_policy("least_busy"), queue_size=4, queue_timeout=1.0, clock=lambda: 1.0)
    old = fleet.get("a")
    old.health.record(True, 0.0)
    for _ in range(4):
        speeds.observe_first_token("a", ttft=4.0, ahead_tokens=0, uncached_tokens=4096, prompt_tokens=4096)
    held = d.try_acquire(RequestFacts(model=None, prompt_tokens=10, long=False))
    assert held is not None
    moved = settings.model_copy(
        update={"instances": [settings.instances[0].model_copy(update={"url": "http://127.0.0.1:9999"})]}
    )
    added, removed, changed = fleet.apply(moved, specs_from_settings(moved, {}))
    assert (added, removed, changed) == ([], [], ["a"])
    new = fleet.get("a")
    assert new is not old and old.retired and not new.up and new.inflight == 0
    assert speeds.samples("a") == 0
    # Pointed back while its request still runs there: the old instance again, its cap counting it.
    added, removed, changed = fleet.apply(settings, specs_from_settings(settings, {}))
    assert (added, removed, changed) == ([], [], ["a"])
    assert fleet.get("a") is old and not old.retired and old.inflight == 1 and old.up
    held[0].release()
    assert fleet.all_inflight() == 0


def test_an_instance_moved_to_or_from_the_overflow_channel_is_probed_or_assumed_up_anew() -> None:
    """The overflow channel is never probed and assumed up; a fleet member is probed. The same
    server moved from one to the other by reload is a new instance of its kind."""
    members = _settings(2, 1.0, True, names=("a", "hosted"))
    overflow = members.model_copy(
        update={"instances": members.instances[:1], "overflow": members.instances[1]}
    )
    fleet = Fleet(overflow, SpeedEstimator())
    fleet.apply(overflow, specs_from_settings(overflow, {}))
    assert fleet.get("hosted").up
    fleet.apply(members, specs_from_settings(members, {}))
    member = fleet.get("hosted")
    assert not member.spec.overflow and not member.up  # probed before it takes work
    member.health.record(False, 0.0)
    member.health.record(False, 0.0)
    member.health.record(False, 0.0)
    fleet.apply(overflow, specs_from_settings(overflow, {}))
    assert fleet.get("hosted").spec.overflow and fleet.get("hosted").up
