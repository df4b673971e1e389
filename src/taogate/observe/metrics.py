"""Every ``taogate_*`` metric, declared in one place on an injected registry.

Per-request metrics are counters and histograms updated once at the end of a request (never inside
the picker), in plain numbers (``plain_metrics``). Per-instance state (in-flight, queued prefill,
health, breaker, engine scrape, speed) is read from the live objects at scrape time by a collector,
so it costs nothing per request.

Label values are bounded: instance names come from config, tags from ``[prefill] tag`` (or ``none``),
routes from the route table, models from what the instances serve (``unknown`` otherwise), priority
classes clamped to 0-9, client keys from ``[[keys]]`` (and ``unified``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from mypy_extensions import mypyc_attr
from prometheus_client import CollectorRegistry, Counter, Histogram, Info
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from taogate import __version__
from taogate.build import BUILD
from taogate.fleet.engine import hit_rate
from taogate.observe.plain_metrics import CounterChild as PlainCounterChild
from taogate.observe.plain_metrics import HistogramChild, PlainCounter, PlainHistogram

if TYPE_CHECKING:
    from taogate.fleet.dispatcher import Dispatcher
    from taogate.fleet.fleet import Fleet
    from taogate.tenancy.limiter import Limiter

#: Priority classes as labels: clamped to 0-9, so a client cannot grow the label set.
_PRIORITY_LABELS = tuple(str(i) for i in range(10))


def priority_label(priority: int) -> str:
    return _PRIORITY_LABELS[min(max(priority, 0), 9)]


#: The metrics ``GatewayMetrics.child`` takes: plain ones, and prometheus_client's.
Metered = PlainCounter | PlainHistogram | Counter | Histogram

# From a 5 ms tiny request to a multi-minute long-prefill stream.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300)


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}
        self._metrics: dict[int, Metered] = {}
        self._series: dict[tuple[str, str, str, str, str], RequestSeries] = {}
        self.build = Info(
            "taogate_build",
            "The running taogate: its version, and whether its request path is compiled or Python.",
            registry=registry,
        )
        self.build.info({"version": __version__, "request_path": BUILD})
        self.requests = PlainCounter(
            "taogate_requests",
            "Requests answered, by route, model, instance, status class and tag.",
            ["route", "model", "instance", "status_class", "tag"],
            registry=registry,
        )
        self.duration = PlainHistogram(
            "taogate_request_duration_seconds",
            "Whole request time at the gateway, queue wait included.",
            ["route", "instance", "tag"],
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.ttfb = PlainHistogram(
            "taogate_time_to_first_byte_seconds",
            "Time from dispatch to the instance's first response byte (TTFT for streams).",
            ["route", "instance", "tag"],
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.queue_wait = PlainHistogram(
            "taogate_queue_wait_seconds",
            "Time requests waited in the gateway queue for a slot.",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.priority_requests = PlainCounter(
            "taogate_priority_requests",
            "Requests answered, by priority class (clamped to 0-9) and status class.",
            ["priority", "status_class"],
            registry=registry,
        )
        self.priority_queue_wait = PlainHistogram(
            "taogate_priority_queue_wait_seconds",
            "Time requests waited in the gateway queue for a slot, by priority class (clamped to 0-9).",
            ["priority"],
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.prompt_tokens = PlainCounter(
            "taogate_prompt_tokens",
            "Prompt tokens sent to instances (from upstream usage when present, else estimated).",
            ["instance", "tag", "source"],
            registry=registry,
        )
        self.completion_tokens = PlainCounter(
            "taogate_completion_tokens",
            "Completion tokens reported by instances.",
            ["instance"],
            registry=registry,
        )
        self.rejections = PlainCounter(
            "taogate_rejections",
            "Requests the gateway refused, by reason.",
            ["reason"],
            registry=registry,
        )
        self.retries = PlainCounter(
            "taogate_retries",
            "Attempts retried on another instance, by reason of the failed attempt.",
            ["reason"],
            registry=registry,
        )
        self.retries_denied = PlainCounter(
            "taogate_retries_denied",
            "Failed attempts not retried: attempts exhausted or retry budget spent.",
            ["reason"],
            registry=registry,
        )
        self.decisions = PlainCounter(
            "taogate_dispatch_decisions",
            "Dispatch picks by strategy and reason (least_load, affinity_hit, affinity_override, ...).",
            ["strategy", "reason"],
            registry=registry,
        )
        self.channel_fallbacks = PlainCounter(
            "taogate_channel_fallbacks",
            "Requests sent outside their long/short channel because it had no healthy instance.",
            ["channel"],
            registry=registry,
        )
        self.stream_errors = PlainCounter(
            "taogate_stream_errors",
            "Streams that ended early after their first byte, by reason.",
            ["instance", "reason"],
            registry=registry,
        )
        self.client_disconnects = PlainCounter(
            "taogate_client_disconnects",
            "Requests whose client went away before the response was complete.",
            registry=registry,
        )
        self.health_transitions = PlainCounter(
            "taogate_health_transitions",
            "Health, breaker and slow-card changes per instance (kind speed: a slow card measured again).",
            ["instance", "kind", "to"],
            registry=registry,
        )

    def count_transition(self, instance: str, kind: str, to: str) -> None:
        self.child(self.health_transitions, instance, kind, to).inc()

    def child(self, metric: Metered, *labels: str) -> Any:
        """``metric.labels(*labels)``, cached: the lookup costs several times the cached child
        (measured: benchmarks/overhead.py), and label sets are bounded (see the module docstring)."""
        key = (id(metric), labels)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*labels)
            self._metrics[id(metric)] = metric
        return found

    def series(self, route: str, model: str, instance: str, status_class: str, tag: str) -> RequestSeries:
        """The children one request's accounting updates, for its label values: found with one
        lookup, and each child resolved through ``child`` the first time it is used."""
        key = (route, model, instance, status_class, tag)
        found = self._series.get(key)
        if found is None:
            found = self._series[key] = RequestSeries(self, key)
        return found

    def forget_instance(self, name: str) -> None:
        """Drop every label set naming an instance that left the fleet (discovery churn would
        otherwise grow /metrics without bound). Per-instance series go through ``child``."""
        self._series.clear()  # they hold children; rebuilt through ``child`` as requests come
        for key in list(self._children):
            metric = self._metrics[key[0]]
            names: tuple[str, ...] = metric._labelnames  # prometheus_client keeps them here
            if "instance" in names and key[1][names.index("instance")] == name:
                del self._children[key]
                metric.remove(*key[1])


class RequestSeries:
    """The children of ``taogate_requests``, the duration and TTFB histograms and the token
    counters for one (route, model, instance, status class, tag): each resolved when a request
    first updates it, so a series no request touched is not exposed."""

    __slots__ = (
        "_completion",
        "_duration",
        "_estimate",
        "_metrics",
        "_ttfb",
        "_usage",
        "instance",
        "requests",
        "route",
        "tag",
    )

    def __init__(self, metrics: GatewayMetrics, labels: tuple[str, str, str, str, str]) -> None:
        """``labels``: route, model, instance, status class, tag (``taogate_requests``' own)."""
        self._metrics = metrics
        route, _, instance, _, tag = labels
        self.route, self.instance, self.tag = route, instance, tag
        self.requests: PlainCounterChild = metrics.child(metrics.requests, *labels)
        self._duration: HistogramChild | None = None
        self._ttfb: HistogramChild | None = None
        self._usage: PlainCounterChild | None = None
        self._estimate: PlainCounterChild | None = None
        self._completion: PlainCounterChild | None = None

    @property
    def duration(self) -> HistogramChild:
        if self._duration is None:
            m = self._metrics
            self._duration = m.child(m.duration, self.route, self.instance, self.tag)
        return self._duration

    @property
    def ttfb(self) -> HistogramChild:
        if self._ttfb is None:
            m = self._metrics
            self._ttfb = m.child(m.ttfb, self.route, self.instance, self.tag)
        return self._ttfb

    @property
    def prompt_usage(self) -> PlainCounterChild:
        if self._usage is None:
            m = self._metrics
            self._usage = m.child(m.prompt_tokens, self.instance, self.tag, "usage")
        return self._usage

    @property
    def prompt_estimate(self) -> PlainCounterChild:
        if self._estimate is None:
            m = self._metrics
            self._estimate = m.child(m.prompt_tokens, self.instance, self.tag, "estimate")
        return self._estimate

    @property
    def completion(self) -> PlainCounterChild:
        if self._completion is None:
            m = self._metrics
            self._completion = m.child(m.completion_tokens, self.instance)
        return self._completion


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
