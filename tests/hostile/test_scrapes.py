"""Hostile scrapers: /metrics answers without a key, so any client may poll it as fast as it likes.
Its renders are bounded: a burst, then at most one a second whatever the rate, and a normal
request beside the pollers is served as beside any other small answers."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Iterable
from typing import Any

import pytest
from prometheus_client.registry import Collector

from tests.hostile.helpers import beside, gateway

pytestmark = pytest.mark.timeout(90)


class Renders(Collector):
    """Counts the registry's renders (one ``collect`` per render); adds no metric."""

    def __init__(self) -> None:
        self.count = 0

    def collect(self) -> Iterable[Any]:
        self.count += 1
        return []


# The pollers run in a process of their own, as real scrapers do: threads of the test's own process
# would take the gateway's GIL and slow its neighbour for reasons of the test, not of the gateway.
_STORM = """
import sys, time, httpx
from concurrent.futures import ThreadPoolExecutor
url, pollers, times = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
def poll(_):
    with httpx.Client(timeout=10) as client:
        return [client.get(url + "/metrics").status_code for _ in range(times)]
t = time.perf_counter()
with ThreadPoolExecutor(pollers) as pool:
    statuses = [s for batch in pool.map(poll, range(pollers)) for s in batch]
print(time.perf_counter() - t, *statuses)
"""


async def _storm(url: str, pollers: int, times: int) -> tuple[float, list[int]]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _STORM, url, str(pollers), str(times), stdout=asyncio.subprocess.PIPE
    )
    out, _ = await proc.communicate()
    took, *statuses = out.split()
    return float(took), [int(s) for s in statuses]


async def test_scrapes_at_any_rate_render_the_metrics_at_most_once_a_second() -> None:
    async with gateway() as (gw, _):
        renders = Renders()
        gw.gateway.registry.register(renders)
        async with beside(gw):
            took, statuses = await _storm(gw.url, 16, 40)
    assert statuses == [200] * 640
    assert renders.count <= 8 + took + 1, f"{renders.count} renders in {took:.1f}s"  # a burst, then 1/s
