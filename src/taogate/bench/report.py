"""Pure math on samples: latency and TTFT percentiles, the max/mean rule, throughput, shares.

Everything here is a function of plain data (``Sample`` rows), so it is tested on fixed numbers.
Percentiles interpolate linearly between closest ranks (numpy's default), so p50 of ``[1, 2, 3, 4]``
is 2.5. Throughput is over the successful requests' span: the first of them sent to the last
finished (a run's errors count apart).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from taogate.bench.runner import Sample
from taogate.instance_settings import instance_label

__all__ = [
    "IMBALANCE_RATIO",
    "Distribution",
    "InstanceShare",
    "Summary",
    "compare",
    "instance_labels",
    "load_spread",
    "percentile",
    "ratio",
    "summarize",
]

#: Max latency over twice the mean means some instance queues longer than the others: fast and slow
#: cards, or uneven dispatch.
IMBALANCE_RATIO = 2.0


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) with linear interpolation; NaN for no values."""
    if not values:
        return math.nan
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be within 0..100, got {q}")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def ratio(a: float, b: float) -> float:
    """a / b, NaN when either side is missing or b is zero."""
    if math.isnan(a) or math.isnan(b) or b == 0:
        return math.nan
    return a / b


@dataclass(frozen=True, slots=True)
class Distribution:
    count: int
    mean: float
    p50: float
    p90: float
    p99: float
    min: float
    max: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Distribution:
        if not values:
            return cls(0, math.nan, math.nan, math.nan, math.nan, math.nan, math.nan)
        return cls(
            count=len(values),
            mean=sum(values) / len(values),
            p50=percentile(values, 50),
            p90=percentile(values, 90),
            p99=percentile(values, 99),
            min=min(values),
            max=max(values),
        )

    @property
    def max_over_mean(self) -> float:
        return ratio(self.max, self.mean)


@dataclass(frozen=True, slots=True)
class InstanceShare:
    """What one instance served: request count, share of successes, tokens, latency, last finish."""

    count: int
    share: float
    prompt_tokens: int
    token_share: float
    mean_latency: float
    last_finish: float


@dataclass(frozen=True, slots=True)
class Summary:
    """One run in numbers (successful requests only, except the error counts)."""

    label: str
    requests: int
    ok: int
    errors: dict[str, int]  # "429" / "0: ReadTimeout" → count
    latency: Distribution
    ttft: Distribution
    span: float  # seconds from the first start to the last end
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    per_instance: dict[str, InstanceShare] = field(default_factory=dict)
    groups: dict[str, Distribution] = field(default_factory=dict)  # latency by workload group

    @property
    def max_over_mean(self) -> float:
        return self.latency.max_over_mean

    @property
    def imbalanced(self) -> bool:
        """Max latency more than ``IMBALANCE_RATIO`` times the mean."""
        return self.max_over_mean > IMBALANCE_RATIO

    @property
    def prompt_tokens_per_s(self) -> float:
        return ratio(self.prompt_tokens, self.span)

    @property
    def requests_per_s(self) -> float:
        return ratio(self.ok, self.span)

    @property
    def cache_hit_rate(self) -> float:
        """Cached over prompt tokens, as the server reported them in ``usage``."""
        return ratio(self.cached_tokens, self.prompt_tokens)

    def as_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data.update(
            max_over_mean=self.max_over_mean,
            imbalanced=self.imbalanced,
            prompt_tokens_per_s=self.prompt_tokens_per_s,
            requests_per_s=self.requests_per_s,
            cache_hit_rate=self.cache_hit_rate,
        )
        clean: dict[str, Any] = _finite(data)
        return clean


def _finite(value: Any) -> Any:
    """NaN → None, recursively (JSON has no NaN)."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def _error_key(sample: Sample) -> str:
    if sample.status:
        return str(sample.status)
    return f"0: {(sample.error or 'error').split(':', 1)[0]}"


def _shares(ok: Sequence[Sample], names: Iterable[str]) -> dict[str, InstanceShare]:
    by: dict[str, list[Sample]] = {name: [] for name in names}
    for s in ok:
        by.setdefault(s.instance or "?", []).append(s)
    tokens_total = sum(s.prompt_tokens for s in ok)
    out = {}
    for name in sorted(by):
        rows = by[name]
        tokens = sum(s.prompt_tokens for s in rows)
        out[name] = InstanceShare(
            count=len(rows),
            share=ratio(len(rows), len(ok)),
            prompt_tokens=tokens,
            token_share=ratio(tokens, tokens_total),
            mean_latency=sum(s.latency for s in rows) / len(rows) if rows else math.nan,
            last_finish=max((s.end for s in rows), default=math.nan),
        )
    return out


def summarize(label: str, samples: Sequence[Sample], instances: Iterable[str] = ()) -> Summary:
    """Summarize one run; ``instances`` lists names that should appear even if they served nothing."""
    ok = [s for s in samples if s.ok]
    errors = Counter(_error_key(s) for s in samples if not s.ok)
    groups: dict[str, list[float]] = {}
    for s in ok:
        groups.setdefault(s.group, []).append(s.latency)
    span = (max(s.end for s in ok) - min(s.start for s in ok)) if ok else math.nan
    return Summary(
        label=label,
        requests=len(samples),
        ok=len(ok),
        errors=dict(sorted(errors.items())),
        latency=Distribution.of([s.latency for s in ok]),
        ttft=Distribution.of([s.ttft for s in ok if s.ttft is not None]),
        span=span,
        prompt_tokens=sum(s.prompt_tokens for s in ok),
        cached_tokens=sum(s.cached_tokens for s in ok),
        completion_tokens=sum(s.completion_tokens for s in ok),
        per_instance=_shares(ok, instances),
        groups={g: Distribution.of(v) for g, v in sorted(groups.items())},
    )


def load_spread(shares: Mapping[str, InstanceShare], names: Iterable[str] | None = None) -> float:
    """Largest request share over the mean share among ``names`` (all by default): 1.0 is even."""
    picked = [shares[n].count for n in (names if names is not None else shares) if n in shares]
    if not picked or sum(picked) == 0:
        return math.nan
    return max(picked) / (sum(picked) / len(picked))


def compare(summary: Summary, baseline: Summary) -> dict[str, float]:
    """Ratios of a run to a baseline (e.g. round robin, or the pooled bound): <1 is lower than it."""
    return {
        "mean_latency": ratio(summary.latency.mean, baseline.latency.mean),
        "max_latency": ratio(summary.latency.max, baseline.latency.max),
        "p99_ttft": ratio(summary.ttft.p99, baseline.ttft.p99),
        "throughput": ratio(summary.prompt_tokens_per_s, baseline.prompt_tokens_per_s),
    }


def instance_labels(urls: Sequence[str]) -> list[str]:
    """``instance_label`` of each URL; a URL given twice is told apart as host:port#2, #3, ..."""
    seen: dict[str, int] = {}
    out: list[str] = []
    for url in urls:
        label = instance_label(url)
        seen[label] = seen.get(label, 0) + 1
        out.append(label if seen[label] == 1 else f"{label}#{seen[label]}")
    return out
