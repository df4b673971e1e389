"""Gauges read from live state when Prometheus scrapes, so they cost nothing per request: each
instance's dispatch state, the gateway queue, precise mode's index, the client keys' tallies and
the upstream connections.

Label values are bounded: instance names come from config or discovery (read from the live fleet,
so those gone go with it), client keys from ``[[keys]]`` (and ``unified``), the KV index's reasons
from a fixed set.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from mypy_extensions import mypyc_attr
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from taogate.fleet.engine import hit_rate

if TYPE_CHECKING:
    from taogate.fleet.dispatcher import Dispatcher
    from taogate.fleet.fleet import Fleet
    from taogate.h1 import Pool
    from taogate.tenancy.limiter import Limiter

__all__ = ["FleetCollector", "KeysCollector", "UpstreamCollector"]


@mypyc_attr(native_class=False)
class FleetCollector(Collector):
    """Per-instance and queue gauges, read from live state when Prometheus scrapes."""

    def __init__(self, fleet: Fleet, dispatcher: Dispatcher, clock: Callable[[], float]) -> None:
        self._fleet = fleet
        self._dispatcher = dispatcher
        self._clock = clock

    def collect(self) -> Iterable[Metric]:
        now = self._clock()
        fleet = self._fleet

        def family(name: str, doc: str) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, doc, labels=["instance"])

        inflight = family("taogate_instance_inflight", "Requests outstanding at the instance (capped).")
        cap = family("taogate_instance_queue_cap", "max_queue_per_instance in force for the instance.")
        prefill = family(
            "taogate_instance_prefill_tokens",
            "Prompt tokens sent to the instance still awaiting a first token.",
        )
        up = family("taogate_instance_up", "1 when health checks pass.")
        available = family("taogate_instance_available", "1 when the instance may take new work.")
        breaker = GaugeMetricFamily(
            "taogate_instance_breaker_state",
            "Circuit breaker state: 1 for the current state.",
            labels=["instance", "state"],
        )
        draining = family("taogate_instance_draining", "1 while the instance is draining.")
        speed = family("taogate_instance_prefill_speed_tokens", "Learned prefill speed, prompt tokens/s.")
        rel = family("taogate_instance_relative_speed", "Learned prefill speed relative to the fleet median.")
        slow = family(
            "taogate_instance_slow", "1 when the instance is flagged slow (speed well below median)."
        )
        waiting = family("taogate_engine_requests_waiting", "vllm:num_requests_waiting at the last scrape.")
        running = family("taogate_engine_requests_running", "vllm:num_requests_running at the last scrape.")
        kv = family("taogate_engine_kv_cache_usage", "KV cache usage (0-1) at the last scrape.")
        hits = family(
            "taogate_engine_prefix_cache_hit_rate", "Prefix cache hit rate between the last scrapes."
        )
        age = family("taogate_engine_scrape_age_seconds", "Seconds since the instance's last good scrape.")
        took = family(
            "taogate_engine_scrape_duration_seconds",
            "How long the last /metrics scrape took (or the one in flight, so far, if longer).",
        )
        stale = family(
            "taogate_engine_stats_stale", "1 while the last scrape is too old for dispatch to trust."
        )
        for inst in fleet:
            n = inst.name
            inflight.add_metric([n], inst.inflight)
            cap.add_metric([n], inst.spec.cap)
            prefill.add_metric([n], inst.prefill_tokens)
            up.add_metric([n], 1.0 if inst.up else 0.0)
            available.add_metric([n], 1.0 if inst.available(now) else 0.0)
            state = inst.breaker.state(now).value
            for s in ("closed", "open", "half_open"):
                breaker.add_metric([n, s], 1.0 if s == state else 0.0)
            draining.add_metric([n], 1.0 if inst.draining else 0.0)
            speed.add_metric([n], fleet.speeds.speed(n))
            rel.add_metric([n], fleet.speeds.relative(n))
            slow.add_metric([n], 1.0 if n in fleet.slow else 0.0)
            duration = inst.scrape_duration(now)
            if duration is not None:
                took.add_metric([n], duration)
            sample = inst.engine
            if sample is not None:
                stale.add_metric([n], 1.0 if inst.stats_stale else 0.0)
                if sample.waiting is not None:
                    waiting.add_metric([n], sample.waiting)
                if sample.running is not None:
                    running.add_metric([n], sample.running)
                if sample.kv_usage is not None:
                    kv.add_metric([n], sample.kv_usage)
                age.add_metric([n], max(0.0, now - inst.engine_at))
                rate = hit_rate(inst.engine_prev, sample) if inst.engine_prev is not None else None
                if rate is not None:
                    hits.add_metric([n], rate)
        queue = GaugeMetricFamily("taogate_queue_length", "Requests waiting in the gateway queue.")
        queue.add_metric([], self._dispatcher.queued)
        yield from (inflight, cap, prefill, up, available, breaker, draining, speed, rel, slow)
        yield from (waiting, running, kv, hits, age, took, stale)
        yield from _kv_index_families(fleet)
        yield queue


def _kv_index_families(fleet: Fleet) -> Iterable[Metric]:
    """Precise mode's state per instance that indexes KV events (the counts restart with the
    subscription)."""
    labels = ["instance"]
    gaps = CounterMetricFamily(
        "taogate_kv_events_gaps", "KV-event batches found missing while the index was trusted.", labels=labels
    )
    restarts = CounterMetricFamily(
        "taogate_kv_events_restarts", "Engine restarts seen in the KV events' sequence.", labels=labels
    )
    trusted = GaugeMetricFamily(
        "taogate_kv_index_trusted",
        "1 while the KV-event index is complete (precise hits used).",
        labels=labels,
    )
    usable = GaugeMetricFamily(
        "taogate_kv_index_usable", "1 while requests' block hashes match the instance's.", labels=labels
    )
    blocks = GaugeMetricFamily(
        "taogate_kv_index_blocks", "Block hashes in the KV-event index.", labels=labels
    )
    by = GaugeMetricFamily(
        "taogate_kv_index_dispatch",
        "1 for what dispatch runs on (index or model) and why (the reason, from a fixed set).",
        labels=["instance", "by", "reason"],
    )
    for inst in fleet:
        index = inst.cache.index
        if index is None:
            continue
        n = [inst.name]
        gaps.add_metric(n, index.gaps)
        restarts.add_metric(n, index.restarts)
        trusted.add_metric(n, 1.0 if index.trusted else 0.0)
        usable.add_metric(n, 1.0 if index.usable else 0.0)
        blocks.add_metric(n, len(index))
        by.add_metric([inst.name, *index.state()], 1.0)
    yield from (gaps, restarts, trusted, usable, blocks, by)


@mypyc_attr(native_class=False)
class KeysCollector(Collector):
    """Per client key (``[[keys]]`` names and ``unified``), read from the limiter's tallies at
    scrape time; a revoked key's series go with it."""

    def __init__(self, limiter: Limiter) -> None:
        self._limiter = limiter

    def collect(self) -> Iterable[Metric]:
        limiter = self._limiter
        requests = CounterMetricFamily(
            "taogate_key_requests", "Requests admitted, by client key.", labels=["key"]
        )
        tokens = CounterMetricFamily(
            "taogate_key_tokens", "Tokens used (from usage), by client key and kind.", labels=["key", "kind"]
        )
        rejections = CounterMetricFamily(
            "taogate_key_rejections", "Requests refused, by client key and reason.", labels=["key", "reason"]
        )
        in_flight = GaugeMetricFamily(
            "taogate_key_in_flight", "Requests in flight, by client key.", labels=["key"]
        )
        for name, stats in limiter.stats.items():
            requests.add_metric([name], stats.requests)
            tokens.add_metric([name, "prompt"], stats.prompt_tokens)
            tokens.add_metric([name, "completion"], stats.completion_tokens)
            for reason, n in stats.rejections.items():
                rejections.add_metric([name, reason], n)
            in_flight.add_metric([name], stats.in_flight)
        up = GaugeMetricFamily(
            "taogate_limits_store_up", "1 while the limits store answers (always 1 for in-process limits)."
        )
        up.add_metric([], 1.0 if limiter.store_up else 0.0)
        return [requests, tokens, rejections, in_flight, up]


@mypyc_attr(native_class=False)
class UpstreamCollector(Collector):
    """The hop's connections to the instances: in use, idle (kept alive for the next request), and
    the limit on them when ``[gateway] max_connections`` sets one."""

    def __init__(self, pool: Pool) -> None:
        self._pool = pool

    def collect(self) -> Iterable[Metric]:
        pool = self._pool
        idle = pool.idle_connections
        connections = GaugeMetricFamily(
            "taogate_upstream_connections",
            "Connections from the gateway to the instances, by state (in_use, idle).",
            labels=["state"],
        )
        connections.add_metric(["in_use"], pool.open_connections - idle)
        connections.add_metric(["idle"], idle)
        yield connections
        if pool.limit is not None:
            yield GaugeMetricFamily(
                "taogate_upstream_connections_limit",
                "[gateway] max_connections: the most connections open at once.",
                value=pool.limit,
            )
