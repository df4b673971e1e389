"""The fleet's side-by-side rows as a terminal table (``taogate status``)."""

from __future__ import annotations

from typing import Any

from rich.table import Table

__all__ = ["STATUS_COLUMNS", "status_table"]

#: (column title, key in a row of ``GET /admin/instances``), in the order shown.
STATUS_COLUMNS: tuple[tuple[str, str], ...] = (
    ("instance", "name"),
    ("health", "health"),
    ("breaker", "breaker"),
    ("in flight", "inflight"),
    ("cap", "cap"),
    ("prefill tok", "prefill_tokens"),
    ("eng wait", "engine_waiting"),
    ("eng run", "engine_running"),
    ("KV", "kv_usage"),
    ("req/1m", "requests_1m"),
    ("TTFT p50", "ttft_p50"),
    ("TTFT p99", "ttft_p99"),
    ("speed x med", "relative_speed"),
    ("verdict", "verdict"),
)


def status_table(data: dict[str, Any], base: str) -> Table:
    """One row per instance of an ``/admin/instances`` answer."""
    table = Table(title=f"taogate at {base}: {data['queued']} waiting in the gateway queue")
    for title, _ in STATUS_COLUMNS:
        table.add_column(title, justify="left" if title in ("instance", "verdict") else "right")
    for row in data["instances"]:
        table.add_row(*("-" if row.get(k) is None else str(row.get(k)) for _, k in STATUS_COLUMNS))
    return table
