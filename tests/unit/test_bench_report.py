"""Report math on fixed samples: percentiles, the article's max/mean rule, throughput, shares, ratios."""

from __future__ import annotations

import math

import pytest

from taogate.bench.report import (
    Distribution,
    compare,
    load_spread,
    percentile,
    ratio,
    summarize,
)
from taogate.bench.runner import Sample


def sample(i: int, start: float, end: float, inst: str = "i0", status: int = 200, **kw: object) -> Sample:
    return Sample(i, "g", start, end, kw.pop("ttft", 0.1), status, inst, **kw)  # type: ignore[arg-type]


def test_percentile_interpolates_linearly_like_numpy() -> None:
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([4, 1, 3, 2], 0) == 1
    assert percentile([4, 1, 3, 2], 100) == 4
    assert percentile(list(range(101)), 99) == pytest.approx(99)
    assert percentile([7], 90) == 7
    assert math.isnan(percentile([], 50))
    with pytest.raises(ValueError):
        percentile([1], 101)


def test_distribution_and_the_article_rule() -> None:
    d = Distribution.of([1.0, 1.0, 1.0, 5.0])
    assert (d.count, d.mean, d.min, d.max) == (4, 2.0, 1.0, 5.0)
    assert d.max_over_mean == 2.5
    empty = Distribution.of([])
    assert empty.count == 0 and math.isnan(empty.mean) and math.isnan(empty.max_over_mean)


def test_summarize_counts_errors_shares_and_throughput() -> None:
    samples = [
        sample(0, 0.0, 1.0, "i0", prompt_tokens=1000, completion_tokens=16, cached_tokens=500),
        sample(1, 0.0, 1.0, "i1", prompt_tokens=1000, completion_tokens=16),
        sample(2, 1.0, 4.0, "i0", prompt_tokens=2000, completion_tokens=16, ttft=2.0),
        sample(3, 0.5, 0.6, None, status=429, error="queue full"),
        sample(4, 0.5, 0.7, None, status=0, error="ReadTimeout: timed out"),
    ]
    s = summarize("run", samples, instances=["i0", "i1", "i2"])
    assert (s.requests, s.ok) == (5, 3)
    assert s.errors == {"0: ReadTimeout": 1, "429": 1}
    assert s.latency.mean == pytest.approx(5 / 3)
    assert s.latency.max == 3.0 and s.latency.min == 1.0
    assert s.max_over_mean == pytest.approx(1.8) and not s.imbalanced
    assert s.span == 4.0  # first start 0.0 to last end 4.0, successes only
    assert s.prompt_tokens_per_s == 1000.0
    assert s.cache_hit_rate == pytest.approx(500 / 4000)
    assert s.ttft.max == 2.0
    assert set(s.per_instance) == {"i0", "i1", "i2"}
    i0 = s.per_instance["i0"]
    assert (i0.count, i0.prompt_tokens, i0.last_finish) == (2, 3000, 4.0)
    assert i0.share == pytest.approx(2 / 3) and i0.token_share == pytest.approx(0.75)
    assert s.per_instance["i2"].count == 0 and math.isnan(s.per_instance["i2"].mean_latency)


def test_imbalance_over_twice_the_mean() -> None:
    samples = [sample(i, 0.0, 1.0) for i in range(9)] + [sample(9, 0.0, 10.0)]
    s = summarize("tail", samples)
    assert s.max_over_mean == pytest.approx(10 / 1.9)
    assert s.imbalanced


def test_as_dict_is_json_safe() -> None:
    s = summarize("empty", [sample(0, 0, 1, status=503, error="down")])
    data = s.as_dict()
    assert data["ok"] == 0 and data["latency"]["mean"] is None and data["max_over_mean"] is None
    assert data["errors"] == {"503": 1}


def test_ratios_and_spread() -> None:
    fast = summarize("fast", [sample(0, 0, 1, prompt_tokens=100), sample(1, 0, 1, "i1", prompt_tokens=100)])
    slow = summarize("slow", [sample(0, 0, 2, prompt_tokens=100), sample(1, 0, 2, "i0", prompt_tokens=100)])
    r = compare(fast, slow)
    assert r["mean_latency"] == 0.5 and r["max_latency"] == 0.5 and r["throughput"] == 2.0
    assert ratio(1, 0) != ratio(1, 0)  # NaN
    assert load_spread(fast.per_instance) == 1.0
    assert load_spread(slow.per_instance) == 1.0  # all on i0: one instance listed
    assert load_spread({**slow.per_instance, "i1": fast.per_instance["i1"]}) == pytest.approx(4 / 3)


def test_each_row_is_compared_with_its_own_reference() -> None:
    """The demo's rows differ in caching: each is compared with the pooled bound that has its own."""
    from rich.console import Console

    from taogate.bench.render import summary_table

    fast = summarize("fast", [sample(0, 0, 1, prompt_tokens=100), sample(1, 0, 1, "i1", prompt_tokens=100)])
    slow = summarize("slow", [sample(0, 0, 2, prompt_tokens=100), sample(1, 0, 2, "i0", prompt_tokens=100)])
    console = Console(width=300, record=True)
    console.print(summary_table([fast, slow], refs=[fast, slow]))
    text = console.export_text()
    rows = [line for line in text.splitlines() if line.lstrip("│ ").startswith(("fast", "slow"))]
    assert len(rows) == 2 and all("1.00x" in row for row in rows), text
    assert "the pooled bound with the row's own caching" in text
