"""endpoint-load-metrics: what vLLM writes (the emulator's, to its byte) and what the gateway reads."""

from __future__ import annotations

from taogate.emulator.responses import load_metrics_header
from taogate.fleet.load_report import LoadReport, parse_load_report


def load_report(fmt: str | None, waiting: int, kv_usage: float) -> bytes | None:
    header = load_metrics_header(fmt, waiting, kv_usage)
    return header[0][1] if header else None


def test_vllms_formats() -> None:
    assert load_report("JSON", 0, 0.0) == (
        b'JSON {"named_metrics": {"num_requests_waiting": 0.0, "kv_cache_usage_perc": 0.0}}'
    )
    assert load_report("text", 3, 0.0123) == (
        b"TEXT named_metrics.num_requests_waiting=3.0, named_metrics.kv_cache_usage_perc=0.0123"
    )
    assert load_report("XML", 0, 0.0) is None and load_report(None, 0, 0.0) is None


def test_the_gateway_reads_both() -> None:
    for fmt in ("JSON", "TEXT"):
        raw = load_report(fmt, 2, 0.5)
        assert raw is not None
        assert parse_load_report(raw) == LoadReport(2.0, 0.5)
    assert parse_load_report("") is None
    assert parse_load_report("JSON {nope") is None
    assert parse_load_report('JSON {"named_metrics": {}}') is None
