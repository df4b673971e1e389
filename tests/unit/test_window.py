from __future__ import annotations

import statistics

from hypothesis import given, settings
from hypothesis import strategies as st

from taogate.fleet.window import RollingWindow, percentile_cut


def test_counts_expire_after_the_window() -> None:
    w = RollingWindow(seconds=60)
    w.record(100.2, ok=True, prompt_tokens=10, completion_tokens=2, ttft=0.5)
    w.record(130.0, ok=False, prompt_tokens=5, completion_tokens=0, ttft=None)
    s = w.stats(130.5)
    assert (s.requests, s.errors, s.prompt_tokens, s.completion_tokens) == (2, 1, 15, 2)
    assert s.ttft_p50 == 0.5 and s.ttft_p99 == 0.5
    s = w.stats(161.0)  # the first record is more than a minute old
    assert (s.requests, s.errors, s.prompt_tokens) == (1, 1, 5)
    assert s.ttft_p50 is None
    assert w.stats(500.0).requests == 0


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 300), st.integers(0, 1000)), max_size=200))
def test_window_matches_a_naive_count(events: list[tuple[float, int]]) -> None:
    events.sort()
    w = RollingWindow(seconds=60)
    for at, tokens in events:
        w.record(at, ok=True, prompt_tokens=tokens, completion_tokens=0, ttft=None)
    now = events[-1][0] if events else 0.0
    oldest = int(now) - 59
    expected = [tokens for at, tokens in events if int(at) >= oldest]
    s = w.stats(now)
    assert s.requests == len(expected)
    assert s.prompt_tokens == sum(expected)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.floats(0, 1e4, allow_nan=False), min_size=1, max_size=600),
    st.integers(1, 99),
)
def test_a_percentile_cut_is_the_statistics_modules_float(values: list[float], i: int) -> None:
    ordered = sorted(values)
    expected = (
        statistics.quantiles(ordered, n=100, method="inclusive")[i - 1] if len(ordered) > 1 else ordered[0]
    )
    assert percentile_cut(ordered, i) == expected
