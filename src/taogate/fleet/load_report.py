"""vLLM's ``endpoint-load-metrics`` answer header: the engine's load as a non-streaming request ends.

The gateway asks for it (``endpoint-load-metrics-format: JSON``) on every non-streaming chat and
completions request; vLLM then answers ``JSON {"named_metrics": {"num_requests_waiting": …,
"kv_cache_usage_perc": …}}`` (``TEXT named_metrics.x=…, …`` is read too). It is fresher than any
scrape for the next decision, and costs no request of its own; streams and idle instances have
none, so scrapes stay the source there.
"""

from __future__ import annotations

from dataclasses import dataclass

import orjson

__all__ = ["REQUEST_HEADER", "RESPONSE_HEADER", "LoadReport", "parse_load_report"]

REQUEST_HEADER = (b"endpoint-load-metrics-format", b"JSON")
RESPONSE_HEADER = "endpoint-load-metrics"


@dataclass(frozen=True, slots=True)
class LoadReport:
    waiting: float | None
    kv_usage: float | None


def _number(value: object) -> float | None:
    if isinstance(value, int | float) and not isinstance(value, bool) and value >= 0:
        return float(value)
    return None


def parse_load_report(value: str | bytes | None) -> LoadReport | None:
    """The waiting count and KV usage of a header value; None when absent or unreadable."""
    if not value:
        return None
    text = value.decode("latin-1") if isinstance(value, bytes) else value
    kind, _, rest = text.strip().partition(" ")
    metrics: dict[str, object] = {}
    if kind.upper() == "JSON":
        try:
            data = orjson.loads(rest)
        except orjson.JSONDecodeError:
            return None
        named = data.get("named_metrics") if isinstance(data, dict) else None
        if not isinstance(named, dict):
            return None
        metrics = named
    elif kind.upper() == "TEXT":
        for item in rest.split(","):
            name, _, raw = item.strip().partition("=")
            try:
                metrics[name.removeprefix("named_metrics.")] = float(raw)
            except ValueError:
                continue
    else:
        return None
    waiting, kv = _number(metrics.get("num_requests_waiting")), _number(metrics.get("kv_cache_usage_perc"))
    if waiting is None and kv is None:
        return None
    return LoadReport(waiting, min(1.0, kv) if kv is not None else None)
