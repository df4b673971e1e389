"""The long-input channel: instance roles, the upstream tag, and fallback when a channel is down."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest

from taogate.emulator.config import EmulatorConfig
from taogate.emulator.fleet import Fleet, run_fleet

from .dispatch_helpers import (
    RunningGateway,
    client,
    complete,
    records,
    serve_gateway,
    settings_for,
    wait_until,
    words,
)

TAG = "longin"
LONG, SHORT = 1_500, 40  # estimated tokens, either side of the 500-token threshold


@asynccontextmanager
async def _channels() -> AsyncIterator[tuple[RunningGateway, Fleet]]:
    """i0 serves long inputs only, i1 short ones only; probes every 0.1 s, down after one failure."""
    async with run_fleet([EmulatorConfig(seed=i) for i in range(2)]) as fleet:
        settings = settings_for(
            fleet.urls,
            roles=["long", "short"],
            prefill={"long_input_threshold": 500, "tag": TAG},
            dispatch={"health_check_interval": 0.1, "unhealthy_after": 1},
        )
        async with serve_gateway(settings) as gate:
            yield gate, fleet


async def test_long_inputs_take_their_own_channel_and_carry_the_tag_upstream() -> None:
    async with _channels() as (gate, fleet), client() as http:
        sizes = [LONG if k % 3 == 0 else SHORT for k in range(24)]
        tasks = [complete(http, gate, words(n, seed=k), max_tokens=2) for k, n in enumerate(sizes)]
        responses = await asyncio.gather(*tasks)
        assert [r.status_code for r in responses] == [200] * 24
        for n, r in zip(sizes, responses, strict=True):
            assert r.headers["x-taogate-instance"] == ("i0" if n == LONG else "i1")
        long_recs, short_recs = records(fleet)
        assert len(long_recs) == 8 and len(short_recs) == 16
        assert all(r["prompt_tokens"] >= 1_000 and r["tag"] == TAG for r in long_recs)
        assert all(r["prompt_tokens"] < 100 and r["tag"] is None for r in short_recs)

        # A client's own tag travels too, with the long-input tag appended.
        r = await complete(http, gate, words(LONG, seed=99), headers={"x-request-tag": "bench"})
        assert r.headers["x-taogate-instance"] == "i0"
        assert records(fleet)[0][-1]["tag"] == f"bench,{TAG}"
        metrics = (await http.get(gate.url + "/metrics")).text
        # The long-input tag is the bounded metric label; the client's own tag never becomes one.
        labels = 'instance="i0",model="emulated-model",route="completions",status_class="2xx"'
        assert f'taogate_requests_total{{{labels},tag="{TAG}"}} 9.0' in metrics
        assert "bench" not in metrics


async def test_a_channel_with_no_healthy_instance_falls_back_to_the_other() -> None:
    async with _channels() as (gate, fleet), client() as http:
        gw = gate.gateway
        fleet.instances[0].faults.unhealthy = True  # the long channel goes down
        await wait_until(lambda: not gw.fleet.get("i0").up, what="long instance marked down")
        longs = await asyncio.gather(*(complete(http, gate, words(LONG, seed=k)) for k in range(3)))
        # Availability beats isolation: served by the short instance, still tagged as long input.
        assert [r.status_code for r in longs] == [200] * 3
        assert {r.headers["x-taogate-instance"] for r in longs} == {"i1"}
        assert [r["tag"] for r in records(fleet)[1]] == [TAG] * 3

        fleet.instances[0].faults.unhealthy = False
        fleet.instances[1].faults.unhealthy = True  # now the short channel is down instead
        await wait_until(lambda: gw.fleet.get("i0").up and not gw.fleet.get("i1").up, what="channels swapped")
        short = await complete(http, gate, words(SHORT, seed=7))
        assert short.status_code == 200 and short.headers["x-taogate-instance"] == "i0"

        # Back to normal: each channel on its own instance again.
        fleet.instances[1].faults.unhealthy = False
        await wait_until(lambda: gw.fleet.get("i1").up, what="short instance back")
        long_again = await complete(http, gate, words(LONG, seed=8))
        short_again = await complete(http, gate, words(SHORT, seed=9))
        assert long_again.headers["x-taogate-instance"] == "i0"
        assert short_again.headers["x-taogate-instance"] == "i1"


async def test_a_channel_fallback_is_visible_in_the_access_log(caplog: pytest.LogCaptureFixture) -> None:
    async with _channels() as (gate, fleet), client() as http:
        gw = gate.gateway
        fleet.instances[0].faults.unhealthy = True
        await wait_until(lambda: not gw.fleet.get("i0").up, what="long instance marked down")
        with caplog.at_level(logging.INFO, logger="taogate.access"):
            r = await complete(http, gate, words(LONG, seed=1), headers={"x-request-id": "fell-back"})
        assert r.status_code == 200 and r.headers["x-taogate-instance"] == "i1"
    lines = [rec.getMessage() for rec in caplog.records if "fell-back" in rec.getMessage()]
    assert lines and "fallback" in lines[0], lines
