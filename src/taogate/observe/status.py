"""The side-by-side view of the fleet: one row per instance (GET /admin/instances, ``taogate status``).

Slow is relative: an instance is slow only against the others, so every instance's queue depth and
completion times show at once. The verdict says what an operator should look at first; the state is
its one word (ok, slow, down, draining) for views that mark rows by it.
"""

from __future__ import annotations

from typing import Any

from taogate.fleet.breaker import BreakerState
from taogate.fleet.dispatcher import Dispatcher
from taogate.fleet.engine import hit_rate
from taogate.fleet.fleet import Fleet
from taogate.fleet.instance import Instance
from taogate.observe.history import RECENT_SECONDS, History
from taogate.settings import DispatchSettings


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


def state(inst: Instance, now: float, slow: bool) -> str:
    if inst.draining:
        return "draining"
    if not inst.up or inst.breaker.state(now) is BreakerState.OPEN:
        return "down"
    return "slow" if slow else "ok"


def _round(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(value, digits)


def _precise(inst: Instance) -> dict[str, str] | None:
    index = inst.cache.index
    if index is None:
        return None
    by, reason = index.state()
    return {"by": by, "reason": reason, "detail": index.off or index.trust.detail}


def status_rows(fleet: Fleet, now: float) -> list[dict[str, Any]]:
    speeds = fleet.speeds
    rows = []
    for inst in fleet:
        engine = inst.engine
        minute = inst.window.stats(now)
        relative = speeds.relative(inst.name)
        slow = inst.name in fleet.slow
        hits = hit_rate(inst.engine_prev, engine) if engine and inst.engine_prev else None
        entries, chain_hashes, indexed = inst.cache.sizes()
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
                "cache_entries": entries,
                "prompt_chain_hashes": chain_hashes,  # plain prompts' blocks sent here
                "kv_index_blocks": indexed,
                # precise mode: dispatch on the KV-event index or on the model, and why (None: no index)
                "precise": _precise(inst),
                "cache_trust": round(inst.cache.model.trust, 3),
                # in-flight followers' mean hit ratio here (None before their answers said): ≥ 0.5
                # after two or more, and they are priced as hits
                "follower_hits": _round(inst.cache.model.follow) if inst.cache.model.follow_seen else None,
                "engine_waiting": engine.waiting if engine else None,
                "engine_running": engine.running if engine else None,
                "kv_usage": _round(engine.kv_usage) if engine else None,
                "prefix_hit_rate": _round(hits),
                "scrape_age": round(now - inst.engine_at, 3) if engine else None,
                "requests_1m": minute.requests,
                "errors_1m": minute.errors,
                "prompt_tokens_1m": minute.prompt_tokens,
                "completion_tokens_1m": minute.completion_tokens,
                "ttft_p50": _round(minute.ttft_p50),
                "ttft_p99": _round(minute.ttft_p99),
                "speed": round(speeds.speed(inst.name), 1),
                "speed_samples": speeds.samples(inst.name),
                # what dispatch prices one output token and the fixed wait at here (seconds)
                "decode_seconds_per_token": _round(speeds.decode_seconds_per_token(inst.name), 5),
                "base_latency": _round(speeds.base_latency(inst.name), 4),
                "relative_speed": round(relative, 3),
                "slow": slow,
                "state": state(inst, now, slow),
                "verdict": verdict(inst, now, slow, relative),
            }
        )
    return rows


def gateway_summary(dispatcher: Dispatcher, dispatch: DispatchSettings, history: History) -> dict[str, Any]:
    """The gateway's own side: its queue, the strategy in force, recent rejections and retries."""
    rejections, retries = history.recent(RECENT_SECONDS)
    return {
        "strategy": dispatch.strategy,
        "prefix_affinity": dispatch.prefix_affinity,
        "queued": dispatcher.queued,
        "queue_size": dispatcher.queue_size,
        "recent_seconds": RECENT_SECONDS,
        "rejections": rejections,
        "retries": retries,
    }
