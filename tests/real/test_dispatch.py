"""Dispatch on the real fast + slow pair, with the gateway's default config: the fast card gets most
of the work whatever the traffic, the slow card is flagged within a minute, and stale engine stats
are said so."""

from __future__ import annotations

import asyncio
import logging
import re
import time

import httpx
import pytest

from tests.real.conftest import Pair, Say
from tests.real.gateway import admin_rows, keep_busy, real_gateway, traffic

FLAG_WITHIN = 60.0  # seconds from the gateway's start


@pytest.mark.parametrize(
    ("stream", "concurrency"),
    [(False, 1), (True, 1), (False, 4), (True, 4)],
    ids=["plain-sequential", "stream-sequential", "plain-concurrent", "stream-concurrent"],
)
async def test_the_fast_card_gets_most_of_the_work_and_the_slow_one_is_flagged(
    vllm_pair: Pair, report: Say, caplog: pytest.LogCaptureFixture, stream: bool, concurrency: int
) -> None:
    caplog.set_level(logging.INFO, logger="taogate.health")
    requests = 30 if concurrency == 1 else 40
    kind = f"{'stream' if stream else 'plain'}, {concurrency} at a time"
    started = time.monotonic()
    async with real_gateway(vllm_pair.servers) as gw:
        served = await traffic(gw, requests=requests, concurrency=concurrency, stream=stream)
        took = time.monotonic() - started
        share = served["fast"] / requests
        report(f"{kind}: the fast card served {served['fast']}/{requests} ({share:.0%}) in {took:.1f} s")
        while not (rows := await admin_rows(gw))["slow"]["slow"]:
            if time.monotonic() - started > FLAG_WITHIN:
                break
            await asyncio.sleep(0.5)
        flagged = time.monotonic() - started
        async with httpx.AsyncClient(timeout=30, trust_env=False) as http:
            text = (await http.get(gw.url + "/metrics")).text
    learned = {n: (r["speed"], r["speed_samples"], r["relative_speed"], r["slow"]) for n, r in rows.items()}
    report(f"{kind}: learned (speed, samples, relative, slow) {learned}; {flagged:.1f} s after start")
    assert share >= 0.8, (served, learned)
    assert rows["slow"]["slow"], (learned, caplog.text[-3000:])
    assert re.search(r'^taogate_instance_slow\{instance="slow"\} 1\.0$', text, re.M)
    assert re.search(r'^taogate_instance_slow\{instance="fast"\} 0\.0$', text, re.M)
    assert "instance slow is slow" in caplog.text


async def test_stale_engine_stats_are_said_so(vllm_pair: Pair, caplog: pytest.LogCaptureFixture) -> None:
    """While vLLM generates long non-streamed answers its /metrics can take seconds to answer: the
    slow scrape and the stats it leaves too old to trust each get a log line and a metric. Both
    cards are kept busy, and either may be the one: which card's /metrics falls behind depends on
    how the host shares its cores (with the servers niced, the fast card's often keeps up)."""
    caplog.set_level(logging.INFO, logger="taogate.health")
    names = [server.spec.label for server in vllm_pair.servers]
    stale_seen: set[str] = set()
    slowest = dict.fromkeys(names, 0.0)
    async with (
        real_gateway(vllm_pair.servers, dispatch={"warmup_tokens": 0}) as gw,
        httpx.AsyncClient(timeout=60, trust_env=False) as http,
        keep_busy(http, vllm_pair.fast, stream=False),
        keep_busy(http, vllm_pair.slow, stream=False),
    ):
        interval = gw.gateway.settings.dispatch.scrape_interval

        def said(name: str) -> bool:
            return (
                name in stale_seen
                and slowest[name] > interval
                and f"instance {name}: engine stats are" in caplog.text
                and f"instance {name}: a scrape of /metrics took" in caplog.text
            )

        # Our /metrics is read all along: the stale flag and a scrape's duration (the one in flight's
        # so far) are gauges, so one read at the wrong moment would miss them.
        deadline = time.monotonic() + 60
        while not any(said(name) for name in names):
            shown = (stale_seen, slowest, caplog.text[-3000:])
            assert time.monotonic() < deadline, shown
            text = (await http.get(gw.url + "/metrics")).text
            for name in names:
                if re.search(rf'^taogate_engine_stats_stale\{{instance="{name}"\}} 1\.0$', text, re.M):
                    stale_seen.add(name)
                took = re.search(
                    rf'^taogate_engine_scrape_duration_seconds\{{instance="{name}"\}} (\S+)$', text, re.M
                )
                slowest[name] = max(slowest[name], float(took.group(1)) if took else 0.0)
            await asyncio.sleep(0.1)
    # That one slow /metrics holds up no other instance's scrapes is shown on emulators
    # (tests/integration/test_engine_learning.py): here both servers share two busy cores.
