"""The load estimate: expected seconds to first token on one instance."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from taogate.dispatch.load import (
    DEFAULT_LOAD,
    LoadModel,
    batch_factor,
    decode_seconds,
    estimate,
    expected_latency,
    expected_ttft,
    kv_wait,
    queued_tokens,
    slowdown,
)
from taogate.dispatch.types import EngineStats, InstanceView


def test_idle_instance_is_prompt_over_speed() -> None:
    view = InstanceView("a", speed=1000.0)
    assert expected_ttft(view, 4096) == pytest.approx(4.096)


def test_own_prefill_work_counts_instantly() -> None:
    view = InstanceView("a", speed=1000.0, inflight=3, prefill_tokens=3 * 4096)
    assert expected_ttft(view, 4096) == pytest.approx(4 * 4.096)


def test_work_not_request_count() -> None:
    many_small = InstanceView("a", inflight=10, prefill_tokens=10 * 50)
    one_long = InstanceView("b", inflight=1, prefill_tokens=8000)
    assert expected_ttft(many_small, 100) < expected_ttft(one_long, 100)


def test_slow_instance_takes_longer_for_the_same_work() -> None:
    fast = InstanceView("f", speed=1000.0, prefill_tokens=4096)
    slow = InstanceView("s", speed=400.0)
    assert expected_ttft(slow, 4096) > expected_ttft(fast, 4096) * 1.2


def test_foreign_waiting_requests_count_but_ours_are_not_double_counted() -> None:
    model = LoadModel(typical_prompt_tokens=1000.0)
    ours = InstanceView("a", inflight=4, prefill_tokens=4000, engine=EngineStats(waiting=4, running=0))
    assert queued_tokens(ours, model) == 4000  # the 4 waiting are ours
    mixed = InstanceView("a", inflight=4, prefill_tokens=4000, engine=EngineStats(waiting=7, running=0))
    assert queued_tokens(mixed, model) == 4000 + 3 * 1000  # 3 from another gateway replica
    stale = InstanceView("a", inflight=4, prefill_tokens=4000, engine=None)
    assert queued_tokens(stale, model) == 4000
    lagging = InstanceView("a", inflight=9, prefill_tokens=9000, engine=EngineStats(waiting=2, running=0))
    assert queued_tokens(lagging, model) == 9000  # clamped at zero


def test_decode_term_is_modest_and_kv_pressure_is_not() -> None:
    idle = InstanceView("a")
    decoding = InstanceView("a", inflight=32, decoding=32)
    assert 1.0 < slowdown(decoding) < 1.05
    assert slowdown(InstanceView("a", engine=EngineStats(waiting=0, running=64))) == slowdown(
        InstanceView("a", engine=EngineStats(waiting=0, running=64), decoding=10)
    )
    assert slowdown(idle) == 1.0

    def at(kv: float, work: int = 0) -> InstanceView:
        engine = EngineStats(0, 0, kv_usage=kv)
        return InstanceView(
            "a", speed=10_000.0, decode_seconds_per_token=0.01, engine=engine, prefill_work=work
        )

    assert kv_wait(at(0.85)) == 0.0
    one = DEFAULT_LOAD.typical_prompt_tokens / 10_000.0 + DEFAULT_LOAD.decode_horizon * 0.01
    near_full, full = kv_wait(at(0.97)), kv_wait(at(1.0))
    assert 0.4 * one < near_full < full == pytest.approx(one)  # a running request's decode and a re-prefill
    # A wait of one request, whatever the queue: not a multiple of the work queued there.
    queued = expected_ttft(at(1.0, 40_000), 4_000) - expected_ttft(at(0.5, 40_000), 4_000)
    assert queued == pytest.approx(one)


def test_own_prefilling_defaults_to_inflight_minus_decoding() -> None:
    assert InstanceView("a", inflight=5, decoding=2).own_prefilling == 3
    assert InstanceView("a", inflight=1, decoding=2).own_prefilling == 0
    assert InstanceView("a", inflight=5, decoding=2, prefilling=1).own_prefilling == 1


engines = st.none() | st.builds(
    EngineStats,
    waiting=st.floats(0, 1000),
    running=st.floats(0, 1000),
    kv_usage=st.none() | st.floats(0, 1),
)
views = st.builds(
    InstanceView,
    name=st.just("a"),
    inflight=st.integers(0, 64),
    decoding=st.integers(0, 64),
    prefill_tokens=st.integers(0, 10**6),
    speed=st.floats(1e-3, 1e6),
    engine=engines,
)


@settings(max_examples=100, deadline=None)
@given(view=views, prompt=st.integers(0, 10**6), extra=st.integers(1, 10**5))
def test_property_finite_nonnegative_and_monotone_in_work(
    view: InstanceView, prompt: int, extra: int
) -> None:
    t = expected_ttft(view, prompt)
    assert 0.0 <= t < float("inf")
    more = InstanceView(
        view.name,
        inflight=view.inflight,
        decoding=view.decoding,
        prefill_tokens=view.prefill_tokens + extra,
        speed=view.speed,
        engine=view.engine,
    )
    assert expected_ttft(more, prompt) > t
    assert expected_ttft(view, prompt + extra) > t


def test_booked_work_counts_only_what_the_prefix_cache_leaves() -> None:
    """Leases book whole prompts; the speed is learned per uncached token (the estimator discounts
    the work ahead by the instance's uncached share), so the queue is discounted the same way:
    otherwise a card whose prompts all hit the cache looks as busy as one prefilling them all."""
    booked = InstanceView("a", speed=1000.0, inflight=4, prefill_tokens=4 * 4096)
    assert queued_tokens(booked) == 4 * 4096  # nothing known about the cache: all of it
    warm = InstanceView("a", speed=1000.0, inflight=4, prefill_tokens=4 * 4096, uncached_ratio=0.05)
    assert queued_tokens(warm) == pytest.approx(0.05 * 4 * 4096)
    assert queued_tokens(InstanceView("a", prefill_tokens=100, uncached_ratio=7.0)) == 100  # clamped
    assert queued_tokens(InstanceView("a", prefill_tokens=100, uncached_ratio=-1.0)) == 0
    foreign = InstanceView("a", uncached_ratio=0.1, engine=EngineStats(waiting=2, running=0))
    assert queued_tokens(foreign, LoadModel(typical_prompt_tokens=1000.0)) == 2000  # not ours: not discounted


def test_each_sequence_sharing_the_steps_slows_the_decode_a_little() -> None:
    model = LoadModel(decode_batch_ref=64.0)
    idle = InstanceView("a", decode_seconds_per_token=0.02)
    assert batch_factor(idle, model) == 1.0
    assert decode_seconds(idle, 16, model) == pytest.approx(16 * 0.02)
    ours = InstanceView("a", inflight=16, decoding=16, decode_seconds_per_token=0.02)
    assert batch_factor(ours, model) == pytest.approx(1.25)
    assert decode_seconds(ours, 16, model) == pytest.approx(16 * 0.02 * 1.25)
    # The engine's own count covers other gateways' sequences (running and waiting to run).
    shared = InstanceView("a", inflight=2, engine=EngineStats(waiting=4, running=28))
    assert batch_factor(shared, model) == pytest.approx(1.5)
    assert batch_factor(ours, LoadModel(decode_batch_ref=0.0)) == 1.0


@settings(max_examples=100, deadline=None)
@given(view=views, more=st.integers(1, 64), ratio=st.floats(0.0, 1.0))
def test_property_the_decode_term_grows_with_the_batch_and_the_queue_with_the_uncached_share(
    view: InstanceView, more: int, ratio: float
) -> None:
    busier = replace(view, inflight=view.inflight + more)
    assert batch_factor(busier) > batch_factor(view) or view.engine is not None
    assert batch_factor(busier) >= batch_factor(view) >= 1.0
    discounted = replace(view, uncached_ratio=ratio)
    assert queued_tokens(discounted) <= queued_tokens(view)
    assert expected_ttft(discounted, 100) <= expected_ttft(view, 100)


full_views = st.builds(
    InstanceView,
    name=st.just("a"),
    inflight=st.integers(-2, 64),
    decoding=st.integers(-2, 64),
    prefilling=st.none() | st.integers(-2, 64),
    prefill_tokens=st.integers(-10, 10**6),
    speed=st.floats(0, 1e6),
    base_latency=st.floats(-1, 5),
    decode_seconds_per_token=st.floats(-0.1, 0.5),
    uncached_ratio=st.floats(-1, 2),
    engine=engines,
)
models = st.builds(
    LoadModel,
    decode_horizon=st.integers(0, 64),
    decode_batch_ref=st.floats(-1, 0) | st.floats(1e-3, 128),
    kv_threshold=st.floats(0, 0.99),
)


@settings(max_examples=300, deadline=None)
@given(
    view=full_views, prompt=st.floats(-10, 10**6), max_tokens=st.none() | st.integers(-5, 10**4), model=models
)
def test_property_the_one_pass_estimate_is_the_formula_term_by_term(
    view: InstanceView, prompt: float, max_tokens: int | None, model: LoadModel
) -> None:
    ttft, latency = estimate(view, prompt, max_tokens, model)
    assert ttft == pytest.approx(expected_ttft(view, prompt, model), rel=1e-12)
    assert latency == pytest.approx(expected_latency(view, prompt, max_tokens, model), rel=1e-12)
