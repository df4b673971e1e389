"""Per-instance figures over the last minute, for the side-by-side status (slow is relative: an
instance is slow only against the others, so every instance's completions and timings show at once).

Counts live in one-second buckets (a fixed ring, so memory does not grow with traffic); TTFT
percentiles come from a bounded reservoir of the most recent samples inside the window.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class WindowStats:
    requests: int
    errors: int
    prompt_tokens: int
    completion_tokens: int
    ttft_p50: float | None
    ttft_p99: float | None


class RollingWindow:
    def __init__(self, seconds: int = 60, max_samples: int = 512) -> None:
        self._seconds = seconds
        self._buckets: list[list[int]] = [[0, 0, 0, 0] for _ in range(seconds)]
        self._stamps = [-1] * seconds  # which second each bucket currently holds
        self._ttft: deque[tuple[float, float]] = deque(maxlen=max_samples)

    def _bucket(self, now: float) -> list[int]:
        second = int(now)
        i = second % self._seconds
        if self._stamps[i] != second:
            self._stamps[i] = second
            self._buckets[i] = [0, 0, 0, 0]
        return self._buckets[i]

    def record(
        self, now: float, *, ok: bool, prompt_tokens: int, completion_tokens: int, ttft: float | None
    ) -> None:
        b = self._bucket(now)
        b[0] += 1
        b[1] += 0 if ok else 1
        b[2] += prompt_tokens
        b[3] += completion_tokens
        if ttft is not None:
            self._ttft.append((now, ttft))

    def stats(self, now: float) -> WindowStats:
        oldest = int(now) - self._seconds + 1
        totals = [0, 0, 0, 0]
        for stamp, bucket in zip(self._stamps, self._buckets, strict=True):
            if stamp >= oldest:
                for k in range(4):
                    totals[k] += bucket[k]
        ttfts = sorted(t for at, t in self._ttft if at >= now - self._seconds)
        return WindowStats(
            requests=totals[0],
            errors=totals[1],
            prompt_tokens=totals[2],
            completion_tokens=totals[3],
            ttft_p50=percentile_cut(ttfts, 50) if ttfts else None,
            ttft_p99=percentile_cut(ttfts, 99) if ttfts else None,
        )


def percentile_cut(ordered: list[float], i: int) -> float:
    """The ``i``-th of the 99 cuts ``statistics.quantiles(ordered, n=100, method="inclusive")``
    gives (linear interpolation between ranks, as the benchmarks' percentiles), the same float, for a
    sorted non-empty list: without the other 98 cuts, which the history's sampler paid for once a
    second per instance. One value is every cut."""
    m = len(ordered) - 1
    j, delta = divmod(i * m, 100)
    if j >= m:
        return ordered[m]
    return (ordered[j] * (100 - delta) + ordered[j + 1] * delta) / 100
