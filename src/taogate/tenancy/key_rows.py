"""What ``GET /admin/keys`` shows of each key: its limits, and what it used on this replica."""

from __future__ import annotations

from typing import Any

from taogate.tenancy.limiter import KeyStats, Limiter
from taogate.tenancy.window import used

__all__ = ["key_rows"]


def key_rows(limiter: Limiter) -> list[dict[str, Any]]:
    """One row per key of ``limiter``'s table (its window as counted at its latest check: by every
    replica, with a shared store)."""
    out = []
    window = limiter.limits.window
    for t in limiter.table:
        stats = limiter.stats.get(t.name) or KeyStats()
        last = stats.last
        recent: dict[str, float] | None = None
        if last is not None:
            recent = {
                "requests": round(used(last.req_prev, last.req_cur, last.frac), 1),
                "tokens": round(used(last.tok_prev, last.tok_cur, last.frac), 1),
            }
        out.append(
            {
                "name": t.name,
                "requests_per_minute": t.requests_per_minute,
                "tokens_per_minute": t.tokens_per_minute,
                "max_concurrency": t.max_concurrency,
                "models": None if t.models is None else sorted(t.models),
                "max_priority": t.max_priority,
                "weight": t.weight,
                "in_flight": stats.in_flight,
                "requests": stats.requests,
                "prompt_tokens": stats.prompt_tokens,
                "completion_tokens": stats.completion_tokens,
                "rejections": dict(stats.rejections),
                "window_seconds": window,
                "window_used": recent,
                "fair_share_tokens": round(limiter.fair.counter(t.name), 1),
            }
        )
    return out
