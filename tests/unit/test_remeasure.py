"""When a card that reads slow is measured again: idle, and no sample for ``after`` seconds."""

from __future__ import annotations

from taogate.control.remeasure import due


def test_a_flagged_idle_card_is_due_once_its_samples_stop_for_long_enough() -> None:
    names, seen = due({"s"}, {"s"}, {"s": 3}, {}, now=0.0, after=60.0)
    assert names == [] and seen == {"s": (3, 0.0)}  # first seen: its clock starts
    names, seen = due({"s"}, {"s"}, {"s": 3}, seen, now=59.0, after=60.0)
    assert names == []
    names, seen = due({"s"}, {"s"}, {"s": 3}, seen, now=60.0, after=60.0)
    assert names == ["s"]


def test_a_new_sample_restarts_the_clock() -> None:
    _, seen = due({"s"}, {"s"}, {"s": 3}, {}, now=0.0, after=60.0)
    names, seen = due({"s"}, {"s"}, {"s": 4}, seen, now=70.0, after=60.0)
    assert names == [] and seen == {"s": (4, 70.0)}


def test_busy_no_longer_slow_or_turned_off_is_never_due() -> None:
    seen = {"s": (3, 0.0), "t": (1, 0.0)}
    assert due({"s"}, set(), {"s": 3}, seen, now=100.0, after=60.0)[0] == []  # requests in flight
    assert due({"s"}, {"s"}, {"s": 3}, seen, now=100.0, after=0.0)[0] == []  # off
    names, kept = due({"s"}, {"s", "t"}, {"s": 3, "t": 1}, seen, now=100.0, after=60.0)
    assert names == ["s"] and "t" not in kept  # no longer a candidate: forgotten
