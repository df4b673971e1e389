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
from tests.real.gateway import LONG_GENERATION, admin_rows, real_gateway, traffic

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
    """While vLLM generates a long non-streamed answer its /metrics hardly answers (seconds): the slow
    scrape and the stats it leaves too old to trust each get a log line and a metric."""
    caplog.set_level(logging.INFO, logger="taogate.health")
    fast = vllm_pair.fast
    body = LONG_GENERATION
    async with (
        real_gateway(vllm_pair.servers, dispatch={"warmup_tokens": 0}) as gw,
        httpx.AsyncClient(timeout=60, trust_env=False) as http,
    ):

        def start() -> asyncio.Future[httpx.Response]:
            return asyncio.ensure_future(http.post(fast.url + "/v1/completions", json=body))

        # One long answer may end before the stats are old enough (a fast card, a quiet moment): a
        # new one starts whenever the last has ended, until the log says so (bounded by the deadline).
        loads = [start()]
        try:
            deadline = time.monotonic() + 45
            while "instance fast: engine stats are" not in caplog.text:
                assert time.monotonic() < deadline, caplog.text
                if loads[-1].done():
                    loads.append(start())
                await asyncio.sleep(0.1)
            stale = (await http.get(gw.url + "/metrics")).text
            while "instance fast: a scrape of /metrics took" not in caplog.text:
                assert time.monotonic() < deadline, caplog.text
                await asyncio.sleep(0.1)
        finally:
            for load in loads:
                load.cancel()
            await asyncio.gather(*loads, return_exceptions=True)
    assert re.search(r'^taogate_engine_stats_stale\{instance="fast"\} 1\.0$', stale, re.M), stale
    took = re.search(r'^taogate_engine_scrape_duration_seconds\{instance="fast"\} (\S+)$', stale, re.M)
    assert took is not None and float(took.group(1)) > 2.0
    # That one slow /metrics holds up no other instance's scrapes is shown on emulators
    # (tests/integration/test_engine_learning.py): here both servers share two busy cores.
