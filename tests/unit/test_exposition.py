"""The /metrics page: renders bounded by a bucket, and a page never older than a render interval."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from taogate.observe.exposition import Exposition


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(0, 0.5), min_size=1, max_size=200), st.integers(1, 10))
def test_renders_are_bounded_and_a_page_is_never_older_than_the_interval(
    gaps: list[float], burst: int
) -> None:
    now = [0.0]
    exposition = Exposition(lambda: str(now[0]).encode(), lambda: now[0], every=1.0, burst=burst)
    for gap in gaps:
        now[0] += gap
        assert now[0] - float(exposition.page()) < 1.0 + 1e-9
    assert exposition.renders <= burst + now[0] + 1e-9


def test_a_few_scrapes_in_a_row_are_fresh() -> None:
    now = [0.0]
    exposition = Exposition(lambda: str(now[0]).encode(), lambda: now[0], every=1.0, burst=3)
    for _ in range(3):
        now[0] += 0.01
        assert float(exposition.page()) == now[0]
    now[0] += 0.01
    assert float(exposition.page()) == now[0] - 0.01
