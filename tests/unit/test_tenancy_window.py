"""The sliding-window arithmetic: what is counted, when a refused request would fit, the headers' times."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from taogate.tenancy.window import State, duration, hit, reset_after, settle, used, wait_for

W = 60_000  # a minute, in ms


def test_requests_past_the_limit_are_refused_and_not_counted() -> None:
    state = None
    admitted = []
    for _ in range(5):
        state, counts = hit(state, 1_000, W, rpm=3, tpm=0, cost=10)
        admitted.append(counts.admitted)
    assert admitted == [True, True, True, False, False]
    assert state is not None and (state.req_cur, state.tok_cur) == (3, 30)


def test_the_previous_bucket_counts_by_the_share_of_it_still_in_the_window() -> None:
    state, _ = hit(None, 0, W, rpm=0, tpm=0, cost=100)
    state, counts = hit(state, W + W // 4, W, rpm=0, tpm=0, cost=0)  # a quarter into the next bucket
    assert (counts.tok_prev, counts.tok_cur, counts.frac) == (100, 0, 0.25)
    assert used(counts.tok_prev, counts.tok_cur, counts.frac) == 75
    state, counts = hit(state, 3 * W, W, rpm=0, tpm=0, cost=0)  # two buckets later: all gone
    assert (counts.tok_prev, counts.tok_cur, counts.req_prev) == (0, 0, 0)


def test_tokens_are_settled_where_they_were_reserved_never_below_zero() -> None:
    state, counts = hit(None, 10, W, rpm=0, tpm=1000, cost=500)
    settle(state, counts.bucket, -300)
    assert state.tok_cur == 200
    state, _ = hit(state, W + 10, W, rpm=0, tpm=1000, cost=0)
    settle(state, counts.bucket, -1000)  # now the previous bucket
    assert state.tok_prev == 0
    settle(state, counts.bucket - 5, 999)  # long gone: nothing to correct
    assert (state.tok_prev, state.tok_cur) == (0, 0)


def test_a_longer_window_reloaded_counts_afresh_instead_of_never_rolling() -> None:
    """Bucket numbers of two lengths do not compare: raised from a minute to two, the old (larger)
    bucket number was kept as "later", and the counts never rolled over again."""
    state, _ = hit(None, 10 * W, W, rpm=2, tpm=0, cost=0)
    state, _ = hit(state, 10 * W + 1, W, rpm=2, tpm=0, cost=0)
    admitted = []
    for minute in (11, 14, 17):  # two-minute buckets, each well past the last
        state, counts = hit(state, minute * W, 2 * W, rpm=2, tpm=0, cost=0)
        admitted.append(counts.admitted)
    assert admitted == [True, True, True]
    assert (state.bucket, state.window_ms) == (17 * W // (2 * W), 2 * W)


def test_a_clock_that_steps_back_keeps_the_later_bucket() -> None:
    state = State(bucket=7, req_cur=2)
    state.roll(6)
    assert (state.bucket, state.req_cur) == (7, 2)


@settings(max_examples=300, deadline=None)
@given(
    prev=st.integers(0, 200),
    cur=st.integers(0, 200),
    frac=st.floats(0, 0.999),
    limit=st.integers(1, 200),
    cost=st.integers(0, 50),
)
def test_property_wait_for_is_the_first_moment_the_request_fits(
    prev: int, cur: int, frac: float, limit: int, cost: int
) -> None:
    """After ``wait_for`` seconds (nothing else counted) the request fits; a little before, it does not."""
    window = 60.0

    def fits_after(t: float) -> bool:
        f = frac + t / window
        if f < 1.0:
            return used(prev, cur, f) + cost <= limit + 1e-6
        return used(cur, 0, f - 1.0) + cost <= limit + 1e-6 if f < 2.0 else cost <= limit

    wait = wait_for(prev, cur, frac, window, limit=limit, cost=cost)
    if cost > limit:
        assert wait is None
        return
    assert wait is not None and wait >= 0
    assert fits_after(wait)
    if wait > 0.01:
        assert not fits_after(wait - 0.01)


def test_reset_is_when_nothing_counted_now_counts_any_more() -> None:
    assert reset_after(0, 0, 0.5, 60) == 0
    assert reset_after(5, 0, 0.5, 60) == 30
    assert reset_after(5, 1, 0.5, 60) == 90


def test_durations_are_written_as_openai_writes_them() -> None:
    assert duration(0.0204) == "21ms"
    assert duration(1.5) == "1.5s"
    assert duration(6.0) == "6s"
    assert duration(360.0) == "6m0s"
    assert duration(61.4) == "1m1s"
    assert [duration(s) for s in (0.9999, 59.9996, 119.6)] == ["1s", "1m0s", "2m0s"]  # never 1m60s
