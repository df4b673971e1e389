"""What the engine reports teaches the gateway: speeds learned from non-stream answers, a slow card
flagged on little evidence, a refused warm-up said so, slow and stale scrapes said so."""

from __future__ import annotations

import asyncio
import logging
import re
import time

import pytest

from taogate.emulator.config import EmulatorConfig
from taogate.emulator.fleet import run_fleet
from tests.conftest import wait_until

from .dispatch_helpers import admin_rows, client, complete, serve_gateway, settings_for, words


def _pair() -> list[EmulatorConfig]:
    # Like the real tier's pair: two batch slots each, the second card six times slower.
    return [EmulatorConfig(seed=i, max_num_seqs=2, slowdown=6.0 if i else 1.0) for i in range(2)]


async def test_non_stream_answers_teach_the_speeds_and_the_fast_card_gets_the_work() -> None:
    async with run_fleet(_pair()) as fleet:
        settings = settings_for(fleet.urls, names=["fast", "slow"], dispatch={"warmup_tokens": 1024})
        async with serve_gateway(settings) as gate, client() as http:
            served = []
            for k in range(20):  # sequential, non-streamed, unique ~1,000-token prompts
                r = await complete(http, gate, words(1_000, seed=k), max_tokens=16)
                assert r.status_code == 200
                served.append(r.headers["x-taogate-instance"])
            await wait_until(lambda: "slow" in gate.app.gateway.fleet.slow, within=5.0, what="slow flagged")
            rows = await admin_rows(http, gate)
    assert served.count("fast") >= 16, served
    # Learned from what the engine measured: both cards, though the slow one served little or nothing.
    assert rows["fast"]["speed_samples"] > 10 and rows["slow"]["speed_samples"] >= 1
    assert rows["slow"]["speed"] < 0.4 * rows["fast"]["speed"], (rows["fast"]["speed"], rows["slow"]["speed"])


async def test_a_refused_warm_up_is_said_so(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="taogate.health")
    async with run_fleet([EmulatorConfig(seed=0)]) as fleet:
        fleet.instances[0].faults.error_rate = 1.0
        async with serve_gateway(settings_for(fleet.urls, dispatch={"warmup_tokens": 64})):
            pass
    assert "instance i0 refused the warm-up (HTTP 500: emulated internal server error" in caplog.text


async def test_slow_and_stale_scrapes_are_said_so(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="taogate.health")
    async with run_fleet([EmulatorConfig(seed=i) for i in range(2)]) as fleet:
        settings = settings_for(fleet.urls, dispatch={"scrape_interval": 0.2})
        async with serve_gateway(settings) as gate, client() as http:
            fleet.instances[1].faults.metrics_delay = 3.0  # a busy vLLM's /metrics
            await wait_until(lambda: "engine stats are" in caplog.text, within=6.0, what="stale said")
            text = (await http.get(gate.url + "/metrics")).text
            assert re.search(r'^taogate_engine_stats_stale\{instance="i1"\} 1\.0$', text, re.M), text
            assert re.search(r'^taogate_engine_stats_stale\{instance="i0"\} 0\.0$', text, re.M)
            took = re.search(r'^taogate_engine_scrape_duration_seconds\{instance="i1"\} (\S+)$', text, re.M)
            assert took is not None and float(took.group(1)) > 1.5  # the scrape in flight, so far
            fleet.instances[1].faults.metrics_delay = 0.0
            await wait_until(lambda: "engine stats are fresh again" in caplog.text, within=6.0, what="fresh")
            await asyncio.sleep(0)
    log = caplog.text
    assert "instance i1: engine stats are" in log and "past the 2.0 s they are trusted for" in log
    assert "instance i1: a scrape of /metrics took 3." in log
    assert "instance i0: engine stats are" not in log  # one slow instance holds up no other's scrapes


async def test_a_card_flagged_slow_and_left_idle_is_measured_again(caplog: pytest.LogCaptureFixture) -> None:
    """A card throttled as it came up is flagged slow and sent nothing, so nothing would teach its
    speed again; once it has recovered, one re-measure clears it, and says so."""
    caplog.set_level(logging.INFO, logger="taogate.health")
    async with run_fleet([EmulatorConfig(seed=i) for i in range(2)]) as fleet:
        fleet.instances[1].faults.throttle = 5.0  # six times slower at its warm-up
        dispatch = {"warmup_tokens": 1024, "health_check_interval": 0.2, "remeasure_after": 0.5}
        settings = settings_for(fleet.urls, names=["fast", "throttled"], dispatch=dispatch)
        async with serve_gateway(settings) as gate, client() as http:
            slow = lambda: gate.app.gateway.fleet.slow  # noqa: E731
            await wait_until(lambda: "throttled" in slow(), within=5.0, what="the throttled card flagged")
            fleet.instances[1].faults.throttle = 0.0
            await wait_until(lambda: not slow(), within=30.0, what="the recovered card cleared")
            text = (await http.get(gate.url + "/metrics")).text
    assert "instance throttled is flagged slow and has taught dispatch nothing for 0.5 s" in caplog.text
    assert "instance throttled is no longer slow" in caplog.text
    counted = r'^taogate_health_transitions_total\{instance="throttled",kind="speed",to="remeasured"\} (\S+)$'
    found = re.search(counted, text, re.M)
    assert found is not None and float(found.group(1)) == 1, text


async def test_a_card_turned_slow_and_starved_before_it_is_flagged_is_measured_until_it_is(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A card that turns six times slower after its warm-up takes one slow sample, too few for the
    detector to be sure, and dispatch sends it nothing more: re-measures add the evidence it lacks."""
    caplog.set_level(logging.INFO, logger="taogate.health")
    async with run_fleet([EmulatorConfig(seed=i) for i in range(3)]) as fleet:
        dispatch = {"warmup_tokens": 1024, "health_check_interval": 0.2, "remeasure_after": 0.5}
        settings = settings_for(fleet.urls, names=["a", "b", "turned"], dispatch=dispatch)
        async with serve_gateway(settings) as gate, client() as http:
            speeds = gate.app.gateway.fleet.speeds
            warmed = lambda: all(speeds.samples(name) >= 1 for name in ("a", "b", "turned"))  # noqa: E731
            await wait_until(warmed, within=10.0, what="the warm-ups in")
            fleet.instances[2].faults.throttle = 5.0
            burst = await asyncio.gather(*(complete(http, gate, words(1_000, seed=k)) for k in range(3)))
            served = [r.headers["x-taogate-instance"] for r in burst]
            for k in range(3, 12):  # one at a time: the two fast cards always have room
                served.append(
                    (await complete(http, gate, words(1_000, seed=k))).headers["x-taogate-instance"]
                )
            slow = lambda: gate.app.gateway.fleet.slow  # noqa: E731
            await wait_until(lambda: "turned" in slow(), within=10.0, what="the turned card flagged")
            text = (await http.get(gate.url + "/metrics")).text
    assert 1 <= served.count("turned") <= 3, served  # starved: the fast cards take the rest
    assert "instance turned reads 0." in caplog.text
    assert "too few or scattered to be sure and has taught dispatch nothing for 0.5 s" in caplog.text
    assert "instance turned is slow: its prefill speed is 0." in caplog.text
    counted = r'^taogate_health_transitions_total\{instance="turned",kind="speed",to="remeasured"\} (\S+)$'
    found = re.search(counted, text, re.M)
    assert found is not None and float(found.group(1)) >= 1, text


async def test_a_gateway_whose_engine_holds_up_its_warm_up_serves_anyway(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A warm-up stuck behind an engine's own work (a gateway restarted under load) holds startup
    up a bounded time, said so, and stopping ends it rather than waiting for its answer."""
    caplog.set_level(logging.INFO)
    async with run_fleet([EmulatorConfig(seed=i) for i in range(2)]) as fleet:
        fleet.instances[1].faults.hang = True  # answers /health, holds every generation
        settings = settings_for(
            fleet.urls, names=["ready", "held"], dispatch={"warmup_tokens": 1024, "warmup_wait": 0.5}
        )
        started = time.monotonic()
        async with serve_gateway(settings) as gate:
            assert gate.app.gateway.fleet.speeds.samples("ready") >= 1
            assert gate.app.gateway.fleet.speeds.samples("held") == 0
        took = time.monotonic() - started
    assert took < 10.0  # the held answer would take the request timeout (30 s)
    assert "serving before the warm-up of held ended" in caplog.text
    assert "instance ready warmed up" in caplog.text and "held: warm-up failed" not in caplog.text
