"""The scrape-time gauges of the upstream pool: connections by state, and its limit when set."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from taogate import h1
from taogate.observe.collectors import UpstreamCollector


def _scrape(pool: h1.Pool) -> str:
    registry = CollectorRegistry()
    registry.register(UpstreamCollector(pool))
    return generate_latest(registry).decode()


def test_the_pool_is_read_at_scrape_time_and_its_limit_only_when_set() -> None:
    times = {"connect_timeout": 1.0, "read_timeout": 1.0, "pool_timeout": 1.0}
    free = _scrape(h1.Pool(None, **times))
    assert 'taogate_upstream_connections{state="in_use"} 0.0' in free
    assert 'taogate_upstream_connections{state="idle"} 0.0' in free
    assert "taogate_upstream_connections_limit" not in free
    assert "taogate_upstream_connections_limit 256.0" in _scrape(h1.Pool(256, **times))
