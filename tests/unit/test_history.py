"""The dashboard's history ring: bounded, ordered, and read back as series, rates and recent counts."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Counter

from taogate.observe.history import RATE_FRAMES, Frame, History, Point, counter_totals


def frame(
    at: float,
    requests: dict[str, float] | None = None,
    *,
    rejections: dict[str, float] | None = None,
    retries: dict[str, float] | None = None,
    queued: int = 0,
) -> Frame:
    per = {"a": 0.0, "b": 0.0} if requests is None else requests
    return Frame(
        at=at,
        queued=queued,
        instances={n: Point(inflight=1, waiting=0, ttft_p99=0.25, requests=r) for n, r in per.items()},
        rejections=rejections or {},
        retries=retries or {},
    )


def test_the_ring_keeps_only_its_capacity() -> None:
    h = History(capacity=10)
    for i in range(25):
        h.add(frame(float(i), queued=i))
    assert len(h) == 10
    p = h.payload()
    assert p["t"] == [float(i) for i in range(15, 25)]
    assert p["queued"] == list(range(15, 25))
    assert p["capacity"] == 10 and len(p["instances"]["a"]["inflight"]) == 10


def test_time_only_goes_forward() -> None:
    h = History(capacity=5)
    h.add(frame(2.0))
    h.add(frame(2.0))
    h.add(frame(1.0))
    assert h.payload()["t"] == [2.0]


def test_since_returns_only_newer_frames() -> None:
    h = History()
    for i in range(6):
        h.add(frame(100.0 + i + 0.0004))  # sent rounded: since is one of the sent stamps
    sent = h.payload()["t"]
    assert h.payload(since=sent[3])["t"] == sent[4:]
    empty = h.payload(since=sent[-1])
    assert empty["t"] == [] and empty["instances"] == {}
    assert h.payload(since=0.0)["t"] == sent


def test_rates_come_from_cumulative_counts_over_a_few_frames() -> None:
    h = History()
    for i in range(12):
        h.add(frame(float(i), {"a": 3.0 * i, "b": 0.0}))
    rps = h.payload()["instances"]["a"]["rps"]
    assert rps[0] is None  # nothing before the first frame
    assert rps[1:] == [3.0] * 11
    assert RATE_FRAMES > 1
    # Only the last frame asked for: its rate still reaches back into the ring.
    assert h.payload(since=10.0)["instances"]["a"]["rps"] == [3.0]


def test_a_counter_that_went_back_gives_no_rate() -> None:
    h = History()
    h.add(frame(1.0, {"a": 50.0}))
    h.add(frame(2.0, {"a": 0.0}))  # its series were removed and started again
    assert h.payload()["instances"]["a"]["rps"] == [None, None]


def test_instances_that_come_and_go_are_padded_with_nothing() -> None:
    h = History()
    h.add(frame(1.0, {"a": 0.0}))
    h.add(frame(2.0, {"a": 1.0, "b": 0.0}))
    h.add(frame(3.0, {"b": 2.0}))
    s = h.payload()["instances"]
    assert s["a"]["inflight"] == [1, 1, None]
    assert s["b"]["inflight"] == [None, 1, 1]
    assert s["b"]["rps"] == [None, None, 2.0]
    assert s["b"]["ttft_p99"] == [None, 0.25, 0.25]


def test_recent_counts_are_the_last_minute_of_the_counters() -> None:
    h = History()
    assert h.recent() == ({}, {})
    h.add(frame(0.0, rejections={"queue_full": 2.0}))
    h.add(frame(30.0, rejections={"queue_full": 5.0}, retries={"connect": 1.0}))
    # Younger than a minute: counted from the oldest frame.
    assert h.recent(60) == ({"queue_full": 3}, {"connect": 1})
    h.add(frame(95.0, rejections={"queue_full": 9.0, "auth": 1.0}, retries={"connect": 1.0}))
    # From the newest frame at least a minute old (the one at 30 s), not from the start.
    assert h.recent(60) == ({"auth": 1, "queue_full": 4}, {})


def test_counter_totals_sum_one_label() -> None:
    registry = CollectorRegistry()
    c = Counter("things", "Things.", ["instance", "route"], registry=registry)
    c.labels("a", "/x").inc(2)
    c.labels("a", "/y").inc(3)
    c.labels("b", "/x").inc()
    assert counter_totals(c, "instance") == {"a": 5.0, "b": 1.0}
    assert counter_totals(c, "route") == {"/x": 3.0, "/y": 3.0}


@settings(max_examples=60, deadline=None)
@given(
    capacity=st.integers(1, 40),
    steps=st.lists(st.floats(0.01, 5.0), max_size=120),
    since_index=st.integers(0, 200),
)
def test_the_ring_is_bounded_and_ordered(capacity: int, steps: list[float], since_index: int) -> None:
    h = History(capacity=capacity)
    at = 0.0
    for step in steps:
        at += step
        h.add(frame(at))
    p = h.payload()
    assert len(p["t"]) == min(capacity, len(steps)) == len(h)
    assert p["t"] == sorted(p["t"])
    for series in p["instances"].values():
        assert all(len(v) == len(p["t"]) for v in series.values())
    if p["t"]:
        since = p["t"][min(since_index, len(p["t"]) - 1)]
        newer = h.payload(since=since)["t"]
        assert newer == [t for t in p["t"] if t > since]
