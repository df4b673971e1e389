"""The request circuit breaker: trip, cool down, one trial, close or reopen; never leak the trial."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from taogate.fleet.breaker import Breaker, BreakerState, BreakerTransition

CLOSED, OPEN, HALF = BreakerState.CLOSED, BreakerState.OPEN, BreakerState.HALF_OPEN


class Logged:
    """A breaker (``breaker``) that keeps every transition its caller is told of, and the OPEN ->
    HALF_OPEN step that claiming a trial makes (``on_dispatch`` reports it as the trial flag only).
    It wraps the breaker rather than subclassing it: the compiled build's classes take no Python
    subclass. Everything else is the breaker's own."""

    def __init__(self, failures: int, cooldown: float, max_cooldown: float | None = None) -> None:
        self.breaker = Breaker(failures, cooldown, max_cooldown)
        self.log: list[BreakerTransition] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.breaker, name)

    def _kept(self, t: BreakerTransition | None) -> BreakerTransition | None:
        if t is not None:
            self.log.append(t)
        return t

    def on_dispatch(self, now: float) -> bool:
        was_open = self.breaker.retry_at() is not None
        trial = self.breaker.on_dispatch(now)
        if trial and was_open:
            self.log.append(BreakerTransition(OPEN, HALF, now, self.breaker.cooldown))
        return trial

    def record_success(self, now: float) -> BreakerTransition | None:
        return self._kept(self.breaker.record_success(now))

    def record_failure(self, now: float) -> BreakerTransition | None:
        return self._kept(self.breaker.record_failure(now))

    def reset(self, now: float) -> BreakerTransition | None:
        return self._kept(self.breaker.reset(now))


def _breaker(
    failures: int = 3, cooldown: float = 10.0, max_cooldown: float | None = None
) -> tuple[Logged, list[BreakerTransition]]:
    b = Logged(failures, cooldown, max_cooldown)
    return b, b.log


def _trip(b: Breaker | Logged, now: float, n: int = 3) -> None:
    for _ in range(n):
        b.record_failure(now)


def test_opens_after_consecutive_failures_only() -> None:
    b, log = _breaker()
    assert b.record_failure(0.0) is None
    b.record_failure(0.0)
    b.record_success(0.0)  # resets the streak
    b.record_failure(1.0)
    b.record_failure(1.0)
    assert b.state(1.0) is CLOSED and log == []
    assert b.record_failure(2.0) == BreakerTransition(CLOSED, OPEN, 2.0, 10.0)
    assert b.state(2.0) is OPEN and not b.allows(2.0)
    assert log == [BreakerTransition(CLOSED, OPEN, 2.0, 10.0)]  # reported once
    assert b.retry_at() == 12.0


def test_half_open_admits_exactly_one_trial_then_closes() -> None:
    b, log = _breaker()
    _trip(b, 0.0)
    assert not b.allows(9.99)
    assert b.state(10.0) is HALF and b.allows(10.0)
    assert len(log) == 1  # reading the state reports nothing
    assert b.on_dispatch(10.0) is True
    assert log[-1] == BreakerTransition(OPEN, HALF, 10.0, 10.0)
    assert not b.allows(10.5)  # a second caller sees no room
    assert b.on_dispatch(10.5) is False  # ...and if it dispatches anyway, it is no second trial
    t = b.record_success(11.0)
    assert t is not None and (t.from_, t.to) == (HALF, CLOSED)
    b.release_trial()  # the trial's lease ends after its verdict: harmless
    assert b.state(11.0) is CLOSED and b.on_dispatch(11.0) is False and b.allows(11.0)


def test_failed_trial_reopens_with_growing_capped_cooldown() -> None:
    b, log = _breaker(cooldown=10.0, max_cooldown=25.0)
    _trip(b, 0.0)
    now = 0.0
    for expected in (20.0, 25.0, 25.0):
        now += b.cooldown
        assert b.on_dispatch(now)
        t = b.record_failure(now)
        assert t is not None and t.to is OPEN and t.cooldown == expected == b.cooldown
        assert not b.allows(now + expected - 0.01) and b.allows(now + expected)
    now += b.cooldown
    assert b.on_dispatch(now)
    b.record_success(now)
    assert b.cooldown == 10.0  # back to base once it closes
    assert [t.to for t in log] == [OPEN, HALF, OPEN, HALF, OPEN, HALF, OPEN, HALF, CLOSED]


def test_release_without_verdict_frees_the_trial_slot() -> None:
    b, _ = _breaker()
    _trip(b, 0.0)
    assert b.on_dispatch(10.0) and not b.allows(10.0)
    b.release_trial()  # client went away: no verdict
    assert b.state(10.0) is HALF and b.allows(10.0) and not b.trial_in_flight


def test_stragglers_cannot_shorten_or_extend_the_cooldown() -> None:
    b, log = _breaker()
    _trip(b, 0.0)
    assert b.record_success(5.0) is None  # a request sent before the trip
    assert b.record_failure(6.0) is None
    assert b.state(6.0) is OPEN and b.retry_at() == 10.0
    assert b.record_success(10.5) is None  # cooldown over but no trial sent yet: still undecided
    assert len(log) == 1


def test_reset_and_reconfigure() -> None:
    b, log = _breaker(cooldown=10.0, max_cooldown=40.0)
    _trip(b, 0.0)
    b.reconfigure(failures=1, cooldown=20.0)  # a reload keeps the ejection in progress
    assert b.state(15.0) is OPEN and b.cooldown == 20.0
    t = b.reset(16.0)
    assert t is not None and t.to is CLOSED and b.consecutive_failures == 0
    assert b.reset(17.0) is None  # already closed: no transition
    assert b.record_failure(18.0) is not None  # failures=1 now
    assert len(log) == 3


def test_rejects_bad_config() -> None:
    with pytest.raises(ValueError):
        Breaker(failures=0, cooldown=1.0)
    with pytest.raises(ValueError):
        Breaker(failures=1, cooldown=0.0)


_OP = st.tuples(
    st.sampled_from(["dispatch", "success", "failure", "release"]),
    st.floats(0.0, 8.0),  # time step
    st.integers(0, 20),  # which outstanding request ends
)


@given(
    failures=st.integers(1, 4),
    cooldown=st.floats(1.0, 10.0),
    grow=st.booleans(),
    ops=st.lists(_OP, max_size=120),
)
def test_invariants(failures: int, cooldown: float, grow: bool, ops: list[tuple[str, float, int]]) -> None:
    """A caller following the protocol: dispatch only when allowed; each request ends once, with a
    verdict or without, and a trial's lease always calls ``release_trial`` at its end."""
    b, log = _breaker(failures, cooldown, cooldown * 4 if grow else None)
    now = 0.0
    outstanding: list[bool] = []  # trial flag of each request in flight
    reported = 0
    for op, dt, pick in ops:
        now += dt
        if op == "dispatch":
            if b.allows(now):
                before = b.state(now)
                trial = b.on_dispatch(now)
                assert trial is (before is HALF)
                outstanding.append(trial)
        elif outstanding:
            trial = outstanding.pop(pick % len(outstanding))
            returned = None
            if op == "success":
                returned = b.record_success(now)
            elif op == "failure":
                returned = b.record_failure(now)
            if returned is not None:
                assert log[-1] is returned
            if trial:
                b.release_trial()
        # The breaker never believes in more than one trial, and never leaks one: when no trial
        # request is in flight any more, the slot is free.
        if not any(outstanding):
            assert not b.trial_in_flight
        # Transitions chain, are reported once (at the moment they happen) and are real changes.
        for t in log[reported:]:
            assert t.from_ is not t.to and t.at == now
        for a, c in itertools.pairwise(log[max(0, reported - 1) :]):
            assert a.to is c.from_
        reported = len(log)
        # OPEN never lets anything through before its cooldown has run.
        if log and log[-1].to is OPEN:
            last = log[-1]
            assert b.cooldown == last.cooldown
            assert b.allows(now) is (now >= last.at + last.cooldown)
            assert cooldown <= last.cooldown <= cooldown * 4
        if b.state(now) is CLOSED:
            assert b.consecutive_failures < failures
        if b.state(now) is not HALF:
            assert not b.trial_in_flight
