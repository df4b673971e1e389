"""Dispatch on the real fast + slow pair, with the gateway's default config: the fast card gets most
of the work whatever the traffic, the slow card is flagged within a minute, and stale engine stats
are said so."""

from __future__ import annotations

import asyncio
import logging
import os
import re
import signal
import time

import httpx
import pytest

from taogate.fleet.engine import stale_after
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
    learned = {
        n: (r["speed"], r["speed_samples"], r["relative_speed"], r["slow"], r["decode_seconds_per_token"])
        for n, r in rows.items()
    }
    what = "(speed, samples, relative, slow, decode pace)"
    report(f"{kind}: learned {what} {learned}; {flagged:.1f} s after start")
    assert share >= 0.8, (served, learned)
    assert rows["slow"]["slow"], (learned, caplog.text[-3000:])
    assert re.search(r'^taogate_instance_slow\{instance="slow"\} 1\.0$', text, re.M)
    assert re.search(r'^taogate_instance_slow\{instance="fast"\} 0\.0$', text, re.M)
    assert "instance slow is slow" in caplog.text


async def test_stale_engine_stats_are_said_so(vllm_pair: Pair, caplog: pytest.LogCaptureFixture) -> None:
    """When a card's /metrics stops answering in time, the slow scrape and the stats it leaves too
    old to trust each get a log line and a metric, and both are said to be over when it answers
    again. Under load vLLM's /metrics took seconds, but how long depends on how the host shares its
    cores (with the servers niced, often not long enough): so the card's HTTP server is paused
    (SIGSTOP) past the staleness limit while it generates a long answer, then resumed."""
    caplog.set_level(logging.INFO, logger="taogate.health")
    slow = vllm_pair.slow
    name = slow.spec.label
    assert slow.child is not None
    stale_seen, slowest = False, 0.0
    async with (
        real_gateway(vllm_pair.servers, dispatch={"warmup_tokens": 0}) as gw,
        httpx.AsyncClient(timeout=60, trust_env=False) as http,
        keep_busy(http, slow, stream=False),
    ):
        interval = gw.gateway.settings.dispatch.scrape_interval
        # Past the staleness limit, and short of the scrape's own timeout: the scrape held up by the
        # pause ends slow, not failed.
        pause = stale_after(interval) + interval / 2
        os.kill(slow.child.pid, signal.SIGSTOP)
        try:
            # Our /metrics is read all along: the stale flag and a scrape's duration (the one in
            # flight's so far) are gauges, so one read at the wrong moment would miss them.
            resume = time.monotonic() + pause
            while time.monotonic() < resume:
                text = (await http.get(gw.url + "/metrics")).text
                stale_seen |= bool(
                    re.search(rf'^taogate_engine_stats_stale\{{instance="{name}"\}} 1\.0$', text, re.M)
                )
                took = re.search(
                    rf'^taogate_engine_scrape_duration_seconds\{{instance="{name}"\}} (\S+)$', text, re.M
                )
                slowest = max(slowest, float(took.group(1)) if took else 0.0)
                await asyncio.sleep(0.1)
        finally:
            os.kill(slow.child.pid, signal.SIGCONT)
        assert stale_seen and slowest > interval, (stale_seen, slowest, caplog.text[-3000:])
        deadline = time.monotonic() + 30
        while f"instance {name}: engine stats are fresh again" not in caplog.text:
            assert time.monotonic() < deadline, caplog.text[-3000:]
            await asyncio.sleep(0.1)
    assert f"instance {name}: engine stats are" in caplog.text
    assert f"instance {name}: a scrape of /metrics took" in caplog.text
    # That one slow /metrics holds up no other instance's scrapes is shown on emulators
    # (tests/integration/test_engine_learning.py): here both servers share two busy cores.
