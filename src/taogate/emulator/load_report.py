"""vLLM's ``endpoint-load-metrics`` response header (ORCA load report), as vLLM 0.32 writes it.

Asked for with ``endpoint-load-metrics-format: JSON`` (or ``TEXT``, any case) on a non-streaming
chat or completions request; any other value, or none, gets no header. The values are the engine's
waiting requests and KV-cache usage as the response is built::

    JSON {"named_metrics": {"num_requests_waiting": 0.0, "kv_cache_usage_perc": 0.0}}
    TEXT named_metrics.num_requests_waiting=0.0, named_metrics.kv_cache_usage_perc=0.0
"""

from __future__ import annotations

import json

__all__ = ["HEADER", "load_report"]

HEADER = b"endpoint-load-metrics"


def load_report(fmt: str | None, waiting: float, kv_usage: float) -> bytes | None:
    metrics = {"num_requests_waiting": float(waiting), "kv_cache_usage_perc": float(kv_usage)}
    kind = (fmt or "").lower()
    if kind == "json":
        return ("JSON " + json.dumps({"named_metrics": metrics})).encode()
    if kind == "text":
        return ("TEXT " + ", ".join(f"named_metrics.{k}={v!r}" for k, v in metrics.items())).encode()
    return None
