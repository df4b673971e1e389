"""The side-by-side view of the fleet: one row per instance (GET /admin/instances, ``taogate status``).

Slow is relative: an instance is slow only against the others, so every instance's queue depth and
completion times show at once. The verdict column says what an operator should look at first.
"""

from __future__ import annotations

from typing import Any

from taogate.fleet.breaker import BreakerState
from taogate.fleet.fleet import Fleet
from taogate.fleet.instance import Instance


def verdict(inst: Instance, now: float, slow: bool, relative: float) -> str:
    if inst.draining:
        return "draining" if inst.inflight else "drained: safe to restart"
    if not inst.up:
        return "down"
    if inst.breaker.state(now) is BreakerState.OPEN:
        return "ejected"
    if slow:
        return f"slow ({relative:.2f}x median): look inside the instance"
    if inst.inflight >= inst.spec.cap:
        return "at cap"
    if not inst.scrape_ok:
        return "ok (no engine metrics)"
    return "ok"


def _round(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(value, digits)


def status_rows(fleet: Fleet, now: float) -> list[dict[str, Any]]:
    speeds = fleet.speeds
    rows = []
    for inst in fleet:
        engine = inst.engine
        minute = inst.window.stats(now)
        relative = speeds.relative(inst.name)
        rows.append(
            {
                "name": inst.name,
                "url": inst.spec.url,
                "role": inst.spec.role,
                "health": inst.health.state.value if not inst.spec.overflow else "assumed_up",
                "breaker": inst.breaker.state(now).value,
                "draining": inst.draining,
                "available": inst.available(now),
                "models": sorted(inst.models),
                "inflight": inst.inflight,
                "cap": inst.spec.cap,
                "prefilling": inst.prefilling,
                "prefill_tokens": inst.prefill_tokens,
                "cache_entries": inst.cache.sizes()[0],
                "kv_index_blocks": inst.cache.sizes()[1],
                "cache_trust": round(inst.cache.model.trust, 3),
                "engine_waiting": engine.waiting if engine else None,
                "engine_running": engine.running if engine else None,
                "kv_usage": _round(engine.kv_usage) if engine else None,
                "scrape_age": round(now - inst.engine_at, 3) if engine else None,
                "requests_1m": minute.requests,
                "errors_1m": minute.errors,
                "prompt_tokens_1m": minute.prompt_tokens,
                "completion_tokens_1m": minute.completion_tokens,
                "ttft_p50": _round(minute.ttft_p50),
                "ttft_p99": _round(minute.ttft_p99),
                "speed": round(speeds.speed(inst.name), 1),
                "speed_samples": speeds.samples(inst.name),
                "relative_speed": round(relative, 3),
                "slow": inst.name in fleet.slow,
                "verdict": verdict(inst, now, inst.name in fleet.slow, relative),
            }
        )
    return rows
