"""The side-by-side view of the fleet: one row per instance (admin API and ``taogate status``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from taogate.gateway import Gateway


def status_rows(gateway: Gateway) -> list[dict[str, Any]]:
    now = gateway.clock()
    speeds = gateway.fleet.speeds
    rows = []
    for inst in gateway.fleet:
        engine = inst.engine
        rows.append(
            {
                "name": inst.name,
                "url": inst.spec.url,
                "role": inst.spec.role,
                "health": "up" if inst.up else inst.health.state.value,
                "breaker": inst.breaker.state(now).value,
                "draining": inst.draining,
                "available": inst.available(now),
                "models": sorted(inst.models),
                "inflight": inst.inflight,
                "cap": inst.spec.cap,
                "prefilling": inst.prefilling,
                "prefill_tokens": inst.prefill_tokens,
                "engine_waiting": engine.waiting if engine else None,
                "engine_running": engine.running if engine else None,
                "kv_usage": engine.kv_usage if engine else None,
                "scrape_age": round(now - inst.engine_at, 3) if engine else None,
                "speed": round(speeds.speed(inst.name), 1),
                "relative_speed": round(speeds.relative(inst.name), 3),
            }
        )
    return rows
