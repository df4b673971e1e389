"""The plain counters and histograms write what prometheus_client's own would."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from taogate.observe.plain_metrics import PlainCounter, PlainHistogram

BUCKETS = (0.005, 0.01, 0.1, 1, 10)


def _without_created(text: bytes) -> list[str]:
    """The exposition minus the ``_created`` values, which differ by when each was made."""
    return [line for line in text.decode().splitlines() if "_created" not in line or line.startswith("#")]


def _created_names(text: bytes) -> list[str]:
    return [line.rsplit(" ", 1)[0] for line in text.decode().splitlines() if "_created{" in line]


@given(
    st.lists(
        st.tuples(
            st.sampled_from(["a", "b", "c"]),
            st.sampled_from(["x", "y"]),
            st.floats(min_value=0, max_value=30, allow_nan=False),
        ),
        max_size=30,
    )
)
def test_the_same_exposition_as_prometheus_client(updates: list[tuple[str, str, float]]) -> None:
    theirs, ours = CollectorRegistry(), CollectorRegistry()
    counters = (
        Counter("t_req", "Requests.", ["i", "k"], registry=theirs),
        PlainCounter("t_req", "Requests.", ["i", "k"], registry=ours),
    )
    histograms = (
        Histogram("t_dur_seconds", "Durations.", ["i"], buckets=BUCKETS, registry=theirs),
        PlainHistogram("t_dur_seconds", "Durations.", ["i"], buckets=BUCKETS, registry=ours),
    )
    bare = (Counter("t_gone", "Gone.", registry=theirs), PlainCounter("t_gone", "Gone.", registry=ours))
    waits = (
        Histogram("t_wait_seconds", "Waits.", buckets=BUCKETS, registry=theirs),
        PlainHistogram("t_wait_seconds", "Waits.", buckets=BUCKETS, registry=ours),
    )
    for i, k, v in updates:
        for c in counters:
            c.labels(i, k).inc(v)
        for h in histograms:
            h.labels(i).observe(v)
        for b in bare:
            b.inc()
        for w in waits:
            w.observe(v)
    for c in counters:
        c.remove("a", "x")
    a, b = generate_latest(theirs), generate_latest(ours)
    assert _without_created(b) == _without_created(a)
    assert _created_names(b) == _created_names(a)


def test_wrong_labels_and_negative_counts_are_refused() -> None:
    counter = PlainCounter("t_req", "Requests.", ["i"], registry=CollectorRegistry())
    with pytest.raises(ValueError, match="takes the labels"):
        counter.labels("a", "b")
    with pytest.raises(ValueError, match="non-negative"):
        counter.labels("a").inc(-1)


def test_a_name_is_registered_once() -> None:
    registry = CollectorRegistry()
    PlainCounter("t_req", "Requests.", registry=registry)
    with pytest.raises(ValueError, match="Duplicated"):
        Counter("t_req", "Requests again.", registry=registry)
