"""A reload builds the new config's parts and swaps them in at one place: the kept state (the
response ids clients chose, the requests in flight, what accounting learned, the retry budget's
window, the queue, the pool's connections) is the same object after it, a request in flight
finishes on the parts it started with, and a config that fails to build changes nothing."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from taogate.app import serve_gateway
from taogate.emulator.config import EmulatorConfig, Faults
from taogate.emulator.fleet import run_fleet
from taogate.settings import ConfigError
from tests.conftest import KEY, gateway_settings, wait_until

AUTH = {"authorization": f"Bearer {KEY}"}

MODEL = "emulated-model"


async def test_a_reload_builds_new_parts_and_carries_the_kept_state_by_name() -> None:
    slow = EmulatorConfig(instant=True, faults=Faults(slow_first_byte=1.0))
    async with run_fleet([slow]) as fleet:
        settings = gateway_settings(fleet.urls, dispatch={"queue_size": 7})
        async with (
            serve_gateway(settings, key=KEY) as gw,
            httpx.AsyncClient(headers=AUTH, timeout=30) as http,
        ):
            gate = gw.gateway
            before = gate.pipeline
            policy, pool = gate.dispatcher.policy, gate.upstream.pool
            body = {"model": MODEL, "prompt": "hello", "max_tokens": 2}
            in_flight = asyncio.create_task(http.post(gw.url + "/v1/completions", json=body))
            await wait_until(lambda: gate.inflight.count == 1, within=10, what="a request in flight")

            new = gateway_settings(
                fleet.urls,
                gateway={"request_timeout": 45, "log_format": "json"},
                dispatch={"queue_size": 9, "oldest_every": 3, "retry": {"budget_ratio": 0.5}},
            )
            gate.reload(new)
            after = gate.pipeline
            assert after is not before and after.settings is new and gate.settings is new
            # kept, by name: the same objects as before the reload
            assert after.responses is before.responses and after.inflight is before.inflight
            assert after.accounting is not before.accounting
            assert after.accounting.tokens is before.accounting.tokens
            assert after.accounting.speeds is before.accounting.speeds
            assert after.budget is not before.budget and after.budget.ratio == 0.5
            assert after.budget.counts(gate.clock()) == before.budget.counts(gate.clock())
            assert gate.dispatcher.policy is policy  # the same kind: its rotation goes on
            assert gate.dispatcher.rules.queue_size == 9 and gate.dispatcher.rules.oldest_every == 3
            assert gate.upstream.pool is pool and pool.limits.read_timeout == 45
            assert float(gate.client.timeout.read or 0) == 45

            r = await in_flight  # finished on the parts it started with
            assert r.status_code == 200, r.text
            assert gate.inflight.count == 0
            r = await http.post(gw.url + "/v1/completions", json=body)
            assert r.status_code == 200

            other = gateway_settings(fleet.urls, dispatch={"strategy": "round_robin"})
            gate.reload(other)
            assert gate.dispatcher.policy is not policy  # another kind: built anew


async def test_a_config_that_fails_to_build_changes_nothing() -> None:
    async with run_fleet([EmulatorConfig(instant=True)]) as fleet:
        settings = gateway_settings(fleet.urls)
        async with serve_gateway(settings, key=KEY) as gw:
            gate = gw.gateway
            pipeline, rules, limits = gate.pipeline, gate.dispatcher.rules, gate.upstream.limits
            unset = {"request_timeout": 99, "api_key_env": "TAOGATE_TEST_UNSET_VARIABLE"}
            broken = gateway_settings(fleet.urls, gateway=unset)
            with pytest.raises(ConfigError):
                gate.reload(broken)
            assert gate.pipeline is pipeline and gate.settings is settings
            assert gate.dispatcher.rules is rules and gate.upstream.limits is limits
