"""The gateway's per-request ``taogate_*`` metrics, declared in one place on an injected registry.

Counters and histograms in plain numbers (``plain_metrics``), updated at a request's edges: the
queue wait and the dispatch decision when a slot is taken, the rest once the request ends; never
inside a dispatch decision. State (each instance's in-flight, queued prefill, health, breaker,
engine scrape, speed; the keys' tallies; the upstream connections) is read from the live objects at
scrape time by the collectors of ``collectors``, so it costs nothing per request.

Label values are bounded: instance names come from config, tags from ``[prefill] tag`` (or ``none``),
routes from the route table, models from what the instances serve (``unknown`` otherwise), priority
classes clamped to -9..9. The client keys' series are ``collectors``'.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Histogram, Info

from taogate import __version__
from taogate.build import BUILD
from taogate.observe.plain_metrics import CounterChild as PlainCounterChild
from taogate.observe.plain_metrics import HistogramChild, PlainCounter, PlainHistogram

if TYPE_CHECKING:
    pass

#: Priority classes as labels: clamped to -9..9, so a client cannot grow the label set, and the
#: classes more urgent than the default (negative: an objective's, or a key's allowed claim) keep a
#: label of their own.
_PRIORITY_LABELS = {i: str(i) for i in range(-9, 10)}


def priority_label(priority: int) -> str:
    return _PRIORITY_LABELS[min(max(priority, -9), 9)]


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
            "Time from dispatch to the instance's first answer: a stream's first event (TTFT), a whole "
            "answer's last byte.",
            ["route", "instance", "tag"],
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.queue_wait = PlainHistogram(
            "taogate_queue_wait_seconds",
            "Time requests waited in the gateway queue, for a slot or for its timeout.",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.priority_requests = PlainCounter(
            "taogate_priority_requests",
            "Requests answered, by priority class (clamped to -9..9) and status class.",
            ["priority", "status_class"],
            registry=registry,
        )
        self.priority_queue_wait = PlainHistogram(
            "taogate_priority_queue_wait_seconds",
            "Time requests waited in the gateway queue (for a slot or its timeout), by priority class "
            "(clamped to -9..9).",
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
            "Attempts retried on another instance, by the failed attempt's instance and reason.",
            ["instance", "reason"],
            registry=registry,
        )
        self.retries_denied = PlainCounter(
            "taogate_retries_denied",
            "Failed attempts not retried (attempts exhausted, budget spent), by instance and reason.",
            ["instance", "reason"],
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
