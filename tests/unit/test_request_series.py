"""``GatewayMetrics.series``: a request's children found with one lookup, exposed only once used,
and dropped with an instance that left the fleet (then counted afresh, not into a removed child);
the priority class's bounded label."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from taogate.observe.metrics import GatewayMetrics, priority_label

LABELS = ("completions", "m", "a", "2xx", "none")
REQUESTS_A = (
    'taogate_requests_total{instance="a",model="m",route="completions",status_class="2xx",tag="none"}'
)


def exposition(metrics: GatewayMetrics) -> str:
    return generate_latest(metrics.registry).decode()


def test_a_series_exposes_only_the_children_a_request_used() -> None:
    metrics = GatewayMetrics(CollectorRegistry())
    series = metrics.series(*LABELS)
    series.requests.inc()
    series.duration.observe(0.01)
    text = exposition(metrics)
    assert (
        'taogate_requests_total{instance="a",model="m",route="completions",status_class="2xx",tag="none"} 1.0'
        in text
    )
    assert 'taogate_request_duration_seconds_count{instance="a",route="completions",tag="none"} 1.0' in text
    assert "taogate_time_to_first_byte_seconds_count{" not in text
    assert "taogate_prompt_tokens_total{" not in text
    assert metrics.series(*LABELS) is series
    assert series.requests is metrics.child(metrics.requests, *LABELS)


def test_a_forgotten_instance_is_counted_afresh_not_into_its_removed_children() -> None:
    metrics = GatewayMetrics(CollectorRegistry())
    series = metrics.series(*LABELS)
    series.requests.inc(3)
    series.completion.inc(5)
    metrics.forget_instance("a")
    assert 'instance="a"' not in exposition(metrics)
    again = metrics.series(*LABELS)
    again.requests.inc()
    again.completion.inc(2)
    text = exposition(metrics)
    assert (
        'taogate_requests_total{instance="a",model="m",route="completions",status_class="2xx",tag="none"} 1.0'
        in text
    )
    assert 'taogate_completion_tokens_total{instance="a"} 2.0' in text


def test_priority_labels_are_bounded_and_urgent_classes_keep_their_own() -> None:
    cases = {-10_000: "-9", -10: "-9", -9: "-9", -3: "-3", 0: "0", 3: "3", 9: "9", 10: "9", 2**63: "9"}
    assert {p: priority_label(p) for p in cases} == cases
