"""The probe state machine: startup, hysteresis, one transition per change."""

from __future__ import annotations

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from taogate.fleet.health import HealthState, HealthTracker, Transition, probe_result


def test_unknown_is_not_eligible_until_first_good_probe() -> None:
    t = HealthTracker(unhealthy_after=2, healthy_after=3)
    assert t.state is HealthState.UNKNOWN and not t.eligible
    assert t.record(True, now=5.0) == Transition(HealthState.UNKNOWN, HealthState.UP, 5.0, 1, 0.0)
    assert t.eligible and t.since == 5.0


def test_loading_instance_goes_down_then_up() -> None:
    t = HealthTracker(unhealthy_after=2, healthy_after=2)
    assert t.record(False, 1.0) is None
    tr = t.record(False, 2.0)
    assert tr is not None and (tr.from_, tr.to, tr.streak) == (HealthState.UNKNOWN, HealthState.DOWN, 2)
    assert t.record(False, 3.0) is None  # no repeated transition while it stays down
    assert t.record(True, 4.0) is None  # hysteresis: needs 2 in a row
    assert t.record(False, 5.0) is None
    assert t.record(True, 6.0) is None
    tr = t.record(True, 7.0)
    assert tr is not None and (tr.to, tr.at, tr.since) == (HealthState.UP, 7.0, 2.0)


def test_up_goes_down_after_consecutive_failures_only() -> None:
    t = HealthTracker(unhealthy_after=3, healthy_after=1)
    t.record(True, 0.0)
    for now, ok in enumerate([False, False, True, False, False], start=1):
        assert t.record(ok, float(now)) is None
    assert t.consecutive_failures == 2
    tr = t.record(False, 6.0)
    assert tr is not None and tr.to is HealthState.DOWN and not t.eligible
    assert t.consecutive_ok == 0


def test_rejects_zero_thresholds() -> None:
    with pytest.raises(ValueError):
        HealthTracker(unhealthy_after=0, healthy_after=1)
    with pytest.raises(ValueError):
        HealthTracker(unhealthy_after=1, healthy_after=1).reconfigure(unhealthy_after=1, healthy_after=0)


def test_reconfigure_keeps_state_and_applies_on_next_probe() -> None:
    t = HealthTracker(unhealthy_after=5, healthy_after=1)
    t.record(True, 0.0)
    t.record(False, 1.0)
    t.record(False, 2.0)
    t.reconfigure(unhealthy_after=2, healthy_after=1)
    assert t.state is HealthState.UP  # no transition from the reload itself
    tr = t.record(False, 3.0)
    assert tr is not None and tr.to is HealthState.DOWN and tr.streak == 3


@pytest.mark.parametrize(
    ("result", "ok"),
    [
        (200, True),
        (204, True),
        (503, False),
        (500, False),
        (404, False),
        (httpx.ConnectError("refused"), False),
        (TimeoutError(), False),
    ],
)
def test_probe_result(result: int | BaseException, ok: bool) -> None:
    assert probe_result(result) is ok


@given(
    unhealthy=st.integers(1, 5),
    healthy=st.integers(1, 5),
    results=st.lists(st.booleans(), max_size=200),
)
def test_never_flaps_faster_than_thresholds(unhealthy: int, healthy: int, results: list[bool]) -> None:
    t = HealthTracker(unhealthy_after=unhealthy, healthy_after=healthy)
    last_change = -1  # index of the probe that caused the previous transition
    for i, ok in enumerate(results):
        tr = t.record(ok, float(i))
        assert t.eligible is (t.state is HealthState.UP)
        if tr is None:
            continue
        assert tr.from_ is not tr.to and tr.to is t.state
        # The transition is justified by a run of identical results, all after the previous change.
        needed = healthy if tr.to is HealthState.UP else unhealthy
        if tr.from_ is HealthState.UNKNOWN and tr.to is HealthState.UP:
            needed = 1
        assert i - last_change >= needed
        assert all(r is ok for r in results[i - needed + 1 : i + 1])
        assert ok is (tr.to is HealthState.UP)
        last_change = i
    # A state never changes without a reported transition: replaying counts agree with the state.
    if t.state is HealthState.UP:
        assert t.consecutive_failures < unhealthy
