"""Failover policy: backoff bounds, what is retryable, the retry budget's bound, and what follows a
failed attempt (judged without I/O)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from taogate import h1
from taogate.errors import GatewayError, NoInstance, UpstreamError, UpstreamTimeout
from taogate.proxy.retry import (
    AttemptFailure,
    Failure,
    FailureKind,
    Next,
    RetryBudget,
    Verdict,
    backoff,
    classify,
    judge,
)
from taogate.proxy.upstream import failure_of

# -- backoff -------------------------------------------------------------------------------------


def test_backoff_doubles_then_caps_with_equal_jitter() -> None:
    assert [backoff(n, 0.5, 8.0, 0.0) for n in range(1, 7)] == [0.25, 0.5, 1.0, 2.0, 4.0, 4.0]
    assert [backoff(n, 0.5, 8.0, 0.999999) for n in (1, 5, 50)] == pytest.approx([0.5, 8.0, 8.0])


def test_backoff_huge_attempt_does_not_overflow() -> None:
    assert backoff(10_000, 0.5, 8.0, 0.5) == 6.0


def test_backoff_zero_base_means_no_wait() -> None:
    assert backoff(3, 0.0, 8.0, 0.5) == 0.0


@pytest.mark.parametrize(("attempt", "rand"), [(0, 0.5), (1, 1.0), (1, -0.1)])
def test_backoff_rejects_bad_arguments(attempt: int, rand: float) -> None:
    with pytest.raises(ValueError):
        backoff(attempt, 0.5, 8.0, rand)


@given(
    attempt=st.integers(1, 200),
    base=st.floats(0.001, 10.0),
    cap=st.floats(0.001, 100.0),
    rand=st.floats(0.0, 1.0, exclude_max=True),
)
def test_backoff_bounds(attempt: int, base: float, cap: float, rand: float) -> None:
    ceiling = min(cap, base * 2.0 ** min(attempt - 1, 1000))
    wait = backoff(attempt, base, cap, rand)
    assert ceiling / 2 <= wait <= ceiling <= cap
    # Monotone in attempt at fixed rand: later retries never wait less.
    assert backoff(attempt + 1, base, cap, rand) >= wait


# -- classification ------------------------------------------------------------------------------


@pytest.mark.parametrize("status", [500, 502, 503, 504])
def test_instance_5xx_is_retried_and_counts_against_it(status: int) -> None:
    assert classify(FailureKind.STATUS, status=status) == Verdict(True, True, f"status_{status}")


@pytest.mark.parametrize("status", [400, 401, 403, 404, 413, 422])
def test_client_4xx_is_never_retried(status: int) -> None:
    v = classify(FailureKind.STATUS, status=status)
    assert not v.retry and not v.instance_fault and v.reason == "status_4xx"


@pytest.mark.parametrize("status", [408, 429])
def test_instance_overload_4xx_is_retried_elsewhere_without_blame(status: int) -> None:
    assert classify(FailureKind.STATUS, status=status) == Verdict(True, False, f"status_{status}")


@pytest.mark.parametrize(
    "kind",
    [
        FailureKind.CONNECT,
        FailureKind.CONNECT_TIMEOUT,
        FailureKind.READ_TIMEOUT,
    ],
)
def test_transport_failures_before_any_byte_are_retried(kind: FailureKind) -> None:
    assert classify(kind) == Verdict(True, True, kind.value)


def test_a_closed_connection_is_retried_without_blaming_the_instance() -> None:
    # The keep-alive race: a pooled connection the server closed as we picked it. Under a burst after
    # a pause thousands fail at once; blaming the instance would eject a healthy fleet (soak.py).
    assert classify(FailureKind.CLOSED) == Verdict(True, False, "closed")


def test_pool_timeout_is_ours_not_the_instance() -> None:
    assert classify(FailureKind.POOL_TIMEOUT) == Verdict(False, False, "pool_timeout")


def test_status_kind_needs_a_status() -> None:
    with pytest.raises(ValueError):
        classify(FailureKind.STATUS)


# -- budget --------------------------------------------------------------------------------------


def test_budget_min_lets_a_quiet_gateway_retry() -> None:
    b = RetryBudget(ratio=0.2, min_per_window=2, window=10.0)
    b.record_request(0.0)
    assert b.try_spend(0.0) and b.try_spend(0.1)
    assert not b.try_spend(0.2)  # 0.2 × 1 + 2 = 2.2 retries at most
    assert b.counts(0.2) == (1, 2)


def test_budget_scales_with_requests_and_refusal_costs_nothing() -> None:
    b = RetryBudget(ratio=0.1, min_per_window=0, window=10.0)
    for i in range(50):
        b.record_request(i * 0.1)
    assert sum(b.try_spend(5.0) for _ in range(20)) == 5
    assert b.counts(5.0) == (50, 5)


def test_budget_window_slides() -> None:
    b = RetryBudget(ratio=0.0, min_per_window=1, window=10.0, buckets=10)
    assert b.try_spend(0.5)
    assert not b.try_spend(9.5)  # same window
    assert b.try_spend(10.5)  # the slice holding the first retry has aged out
    assert b.counts(10.5) == (0, 1)
    assert b.counts(100.0) == (0, 0)


def test_a_reloaded_budget_has_its_own_ratio_over_the_same_window() -> None:
    old = RetryBudget(ratio=0.0, min_per_window=0, window=10.0)
    old.record_request(0.0)
    assert not old.try_spend(0.0)
    new = old.reloaded(1.0)
    assert new.ratio == 1.0 and old.ratio == 0.0
    assert new.counts(0.0) == (1, 0) and new.try_spend(0.0)
    old.record_request(0.5)  # a request still in flight under the old config counts for both
    assert old.counts(0.5) == new.counts(0.5) == (2, 1)
    with pytest.raises(ValueError):
        old.reloaded(-0.5)


def test_budget_rejects_bad_config() -> None:
    with pytest.raises(ValueError):
        RetryBudget(ratio=-1.0, min_per_window=0, window=1.0)
    with pytest.raises(ValueError):
        RetryBudget(ratio=0.1, min_per_window=0, window=0.0)


@given(
    ratio=st.floats(0.0, 1.0),
    minimum=st.integers(0, 3),
    buckets=st.integers(1, 12),
    events=st.lists(st.tuples(st.booleans(), st.floats(0.0, 3.0)), max_size=300),
)
def test_budget_never_exceeds_ratio_times_requests_plus_min(
    ratio: float, minimum: int, buckets: int, events: list[tuple[bool, float]]
) -> None:
    window = 10.0
    width = window / buckets
    b = RetryBudget(ratio, minimum, window, buckets)
    now = 0.0
    requests: list[float] = []
    retries: list[float] = []
    for is_request, dt in events:
        now += dt
        granted = False
        if is_request:
            b.record_request(now)
            requests.append(now)
        elif b.try_spend(now):
            retries.append(now)
            granted = True
        # Independent model: count events in the `buckets` slices ending with the current one.
        first = math.floor(now / width) - buckets + 1

        def within(times: list[float], first: int = first) -> int:
            return sum(1 for t in times if math.floor(t / width) >= first)

        assert b.counts(now) == (within(requests), within(retries))
        # The bound holds at every grant. (Later the requests that earned a retry may age out of the
        # window before the retry does: a sliding budget bounds its decisions, not history.)
        if granted:
            assert within(retries) <= ratio * within(requests) + minimum


def test_has_room_is_what_try_spend_would_do_and_takes_nothing() -> None:
    b = RetryBudget(ratio=0.0, min_per_window=1, window=10.0)
    assert b.has_room(0.0) and b.has_room(0.0)
    assert b.try_spend(0.0)
    assert not b.has_room(0.0) and not b.try_spend(0.0)


# -- judging -------------------------------------------------------------------------------------

HOP_KINDS = [k for k in FailureKind if k is not FailureKind.STATUS]
failures = st.one_of(
    st.builds(
        Failure,
        st.sampled_from(HOP_KINDS),
        st.text(max_size=20),
        st.none(),
        st.booleans(),
    ),
    st.builds(Failure, st.just(FailureKind.STATUS), st.just("HTTP"), st.integers(400, 599), st.booleans()),
)


@given(failure=failures, room=st.booleans())
def test_judging_follows_the_classification(failure: Failure, room: bool) -> None:
    verdict = classify(failure.kind, status=failure.status)
    j = judge(failure, "a", room)
    assert j.reason == verdict.reason
    assert j.blame == (verdict.instance_fault or failure.malformed)
    assert (j.next is Next.RETRY) == (verdict.retry and room)
    assert j.denied == (verdict.retry and not room)
    if failure.kind is FailureKind.STATUS:
        assert j.next in (Next.RETRY, Next.RELAY)  # an instance's answer is never swapped for ours
    else:
        assert j.next in (Next.RETRY, Next.ANSWER)  # a failed hop has nothing to relay
    ends = j.exception()
    if j.next is Next.RETRY:
        assert isinstance(ends, AttemptFailure) and ends.reason == j.reason and ends.instance == "a"
    else:
        assert isinstance(ends, GatewayError)


@pytest.mark.parametrize(
    ("kind", "error", "status"),
    [
        (FailureKind.CONNECT, UpstreamError, 502),
        (FailureKind.CLOSED, UpstreamError, 502),
        (FailureKind.READ_TIMEOUT, UpstreamTimeout, 504),
        (FailureKind.CONNECT_TIMEOUT, UpstreamTimeout, 504),
        (FailureKind.POOL_TIMEOUT, NoInstance, 503),
    ],
)
def test_a_failed_hop_without_room_is_the_gateways_own_error(
    kind: FailureKind, error: type[GatewayError], status: int
) -> None:
    j = judge(Failure(kind, "why"), "inst-1", room=False)
    ends = j.exception()
    assert j.next is Next.ANSWER and type(ends) is error and ends.status == status
    assert "inst-1" in ends.message or kind is FailureKind.POOL_TIMEOUT


def test_a_malformed_answer_is_blamed_where_a_closed_connection_is_not() -> None:
    assert not judge(Failure(FailureKind.CLOSED, "closed"), "a", room=True).blame
    assert judge(Failure(FailureKind.CLOSED, "101", malformed=True), "a", room=True).blame


# -- the hop's failures --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("exc", "kind"),
    [
        (h1.ConnectError("x"), FailureKind.CONNECT),
        (h1.ConnectTimeout("x"), FailureKind.CONNECT_TIMEOUT),
        (h1.PoolTimeout("x"), FailureKind.POOL_TIMEOUT),
        (h1.ReadTimeout("x"), FailureKind.READ_TIMEOUT),
        (h1.WriteTimeout("x"), FailureKind.READ_TIMEOUT),
        (h1.RemoteProtocolError("x"), FailureKind.CLOSED),
        (h1.MalformedResponse("x"), FailureKind.CLOSED),
        (h1.WriteError("x"), FailureKind.CLOSED),
        (h1.TransportError("x"), FailureKind.CLOSED),
    ],
)
def test_every_failure_of_the_hop_has_a_kind(exc: h1.TransportError, kind: FailureKind) -> None:
    failure = failure_of(exc)
    assert failure.kind is kind and failure.status is None
    assert failure.malformed == isinstance(exc, h1.MalformedResponse)
