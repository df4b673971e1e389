"""``derive`` takes each median from one sorted list; it must give, float for float, what taking a
median of the others per instance gave (``_derive_per_instance``, the formulation it replaced)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping

from hypothesis import given, settings
from hypothesis import strategies as st

from taogate.dispatch.speed_params import (
    MIN_BASE_SAMPLES,
    _dispatch_base,
    _median_without,
    derive,
    fleet_median,
)
from taogate.dispatch.speed_state import State


def _unknown_tpot(
    name: str, states: Mapping[str, State], speeds: Mapping[str, float], median: float
) -> float:
    state = states[name]
    factor = 1.0
    others = [speeds[n] / s.weight for n, s in states.items() if n != name and s.evidence > 0]
    if state.evidence > 0 and others:
        factor = statistics.median(others) / max(speeds[name] / state.weight, 1e-9)
    bases = [s.base for n, s in states.items() if n != name and s.base_n >= MIN_BASE_SAMPLES]
    if state.base_n >= MIN_BASE_SAMPLES and state.base > 0 and bases:
        factor = max(factor, state.base / statistics.median(bases))
    return median * min(4.0, max(1.0, factor))


def _derive_per_instance(
    states: Mapping[str, State], *, nominal: float, fast_cap: float, base_prior: float, tpot_prior: float
) -> tuple[float, dict[str, float], dict[str, tuple[float, float, float]]]:
    bases = {n: s.base for n, s in states.items() if s.base_n >= MIN_BASE_SAMPLES and s.base > 0}
    learned = sorted((math.exp(s.log_speed) / s.weight, name) for name, s in states.items() if s.evidence > 0)
    values = [v for v, _ in learned]
    unit = statistics.median(values) if values else nominal
    speeds = {name: s.weight * unit for name, s in states.items()}
    for i, (value, name) in enumerate(learned):
        state = states[name]
        capped = len(values) > 1 and state.guessed and not state.engine
        cap = fast_cap * _median_without(values, i) if capped else math.inf
        speeds[name] = state.weight * min(value, cap)
    for name, s in states.items():
        own = bases.get(name)
        others = [b for n, b in bases.items() if n != name]
        if s.evidence < 1.0 and own is not None and others:
            factor = min(1.0, max(0.25, statistics.median(others) / own))
            speeds[name] *= factor ** (1.0 - s.evidence)
    base_median = fleet_median(states, lambda s: s.base if s.base_n > 0 else None, base_prior)
    tpot_median = fleet_median(states, lambda s: s.tpot if s.tpot_n > 0 else None, tpot_prior)
    params = {
        name: (
            speeds[name],
            _dispatch_base(s, base_median),
            s.tpot if s.tpot_n > 0 else _unknown_tpot(name, states, speeds, tpot_median),
        )
        for name, s in states.items()
    }
    return unit, speeds, params


def _state(draw: st.DrawFn) -> State:
    state = State(
        math.log(draw(st.sampled_from([500.0, 1000.0, 4000.0, 10_000.0, 12_345.6]))),
        draw(st.sampled_from([0.5, 1.0, 1.0, 2.0])),
        draw(st.sampled_from([0.01, 0.02, 0.05])),
        draw(st.sampled_from([0.0, 0.01, 0.02, 0.2, 0.013])),
    )
    state.evidence = draw(st.sampled_from([0.0, 0.0, 0.3, 1.0, 5.0]))
    state.base_n = draw(st.integers(0, 5))
    state.tpot_n = draw(st.integers(0, 2))
    state.guessed = draw(st.booleans())
    state.engine = draw(st.booleans())
    return state


@st.composite
def fleets(draw: st.DrawFn) -> dict[str, State]:
    return {f"i{k}": _state(draw) for k in range(draw(st.integers(0, 7)))}


@settings(max_examples=500, deadline=None)
@given(states=fleets())
def test_derive_equals_a_median_per_instance(states: dict[str, State]) -> None:
    kw = {"nominal": 10_000.0, "fast_cap": 2.0, "base_prior": 0.0, "tpot_prior": 0.02}
    try:
        expected: object = _derive_per_instance(states, **kw)
    except ZeroDivisionError as exc:  # a learned fixed latency of 0: both divide by it
        expected = type(exc)
    try:
        got = derive(states, **kw)
    except ZeroDivisionError as exc:
        assert type(exc) is expected
    else:
        assert (got.unit, got.speeds, got.params) == expected


@settings(max_examples=300, deadline=None)
@given(
    values=st.lists(st.sampled_from([0.5, 1.0, 2.0, 3.25, 7.0, 1e-3]), min_size=2, max_size=9),
    at=st.integers(0, 8),
)
def test_median_without_one_is_the_median_of_the_others(values: list[float], at: int) -> None:
    ordered = sorted(values)
    i = at % len(ordered)
    assert _median_without(ordered, i) == statistics.median(ordered[:i] + ordered[i + 1 :])
