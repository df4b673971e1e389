"""Overload: the hard per-instance cap, the bounded gateway queue (429 + Retry-After), 503 when nothing
is healthy, and a lowered cap moving work away from a deep queue. Real servers on 127.0.0.1."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai

from taogate.emulator.config import EmulatorConfig
from taogate.emulator.fleet import run_fleet
from tests.conftest import KEY

from .dispatch_helpers import (
    MODEL,
    PeakWatch,
    admin_rows,
    client,
    complete,
    serve_gateway,
    served_counts,
    settings_for,
    wait_until,
    words,
)


def _is_openai_error(r: httpx.Response, status: int, code: str) -> None:
    assert r.status_code == status, (r.status_code, r.text)
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == code, err
    assert int(r.headers["retry-after"]) >= 1


async def test_cap_holds_and_the_excess_gets_429_with_retry_after_under_a_burst() -> None:
    # ~40 decode steps of >= 20 ms: each request holds its slot for ~0.8 s, longer than the burst takes.
    configs = [EmulatorConfig(seed=i, step_overhead=0.02) for i in range(2)]
    async with run_fleet(configs) as fleet:
        settings = settings_for(
            fleet.urls,
            dispatch={"max_queue_per_instance": 2, "queue_size": 3, "queue_timeout": 10.0},
        )
        async with serve_gateway(settings) as gate, client() as http:
            gw = gate.gateway
            insts = [gw.fleet.get(f"i{n}") for n in range(2)]

            def work_conserving() -> None:
                # Nobody waits in the gateway queue while an instance has a free slot.
                if gw.dispatcher.queued:
                    assert all(i.inflight == 2 for i in insts), [i.inflight for i in insts]

            gateway_watch = PeakWatch(lambda: [i.inflight for i in insts], check=work_conserving)
            engine_watch = PeakWatch(lambda: [e.book.in_flight for e in fleet.instances])
            queue_watch = PeakWatch(lambda: [gw.dispatcher.queued])
            async with gateway_watch, engine_watch, queue_watch:
                burst = [complete(http, gate, words(200, seed=k), max_tokens=40) for k in range(20)]
                responses = await asyncio.gather(*burst)

            ok = [r for r in responses if r.status_code == 200]
            refused = [r for r in responses if r.status_code != 200]
            assert gateway_watch.peaks == [2, 2], gateway_watch.peaks  # the cap was reached, never passed
            assert max(engine_watch.peaks) <= 2, engine_watch.peaks  # as the engines saw it, too
            assert queue_watch.peaks == [3]  # the queue filled up to its bound
            assert len(ok) >= 7, len(ok)  # 4 slots + 3 queued, all served (work-conserving)
            assert len(ok) + len(refused) == 20 and len(refused) >= 5
            for r in refused:
                _is_openai_error(r, 429, "queue_full")
                assert r.json()["error"]["type"] == "rate_limit_error"
            assert {r.headers["x-taogate-instance"] for r in ok} == {"i0", "i1"}

            # Afterwards nothing is left held anywhere.
            rows = await admin_rows(http, gate)
            assert all(row["inflight"] == 0 and row["prefill_tokens"] == 0 for row in rows.values()), rows
            assert (await http.get(gate.url + "/admin/instances")).json()["queued"] == 0
            assert all(e.book.in_flight == 0 for e in fleet.instances)
            metrics = (await http.get(gate.url + "/metrics")).text
            assert f'taogate_rejections_total{{reason="queue_full"}} {len(refused)}.0' in metrics


async def test_queue_timeout_gives_429_queue_timeout_and_the_sdk_sees_a_rate_limit() -> None:
    async with run_fleet([EmulatorConfig(step_overhead=0.02)]) as fleet:
        settings = settings_for(
            fleet.urls, dispatch={"max_queue_per_instance": 1, "queue_size": 4, "queue_timeout": 0.3}
        )
        async with serve_gateway(settings) as gate, client() as http:
            # Holds the only slot for ~1.2 s (60 decode steps of >= 20 ms).
            holder = asyncio.create_task(complete(http, gate, "hold the slot", max_tokens=60))
            await wait_until(lambda: gate.gateway.fleet.get("i0").inflight == 1, what="slot taken")
            t0 = time.monotonic()
            r = await complete(http, gate, "waits in the queue")
            waited = time.monotonic() - t0
            _is_openai_error(r, 429, "queue_timeout")
            assert 0.25 < waited < 1.0, waited  # gave up at queue_timeout, not when the slot freed
            assert not holder.done()

            sdk = openai.AsyncOpenAI(base_url=gate.api_base, api_key=KEY, max_retries=0, timeout=10)
            try:
                try:
                    await sdk.completions.create(model=MODEL, prompt="again", max_tokens=1)
                except openai.RateLimitError as exc:
                    assert exc.status_code == 429
                    assert exc.response.headers["retry-after"].isdigit()
                    assert isinstance(exc.body, dict) and exc.body["code"] == "queue_timeout"
                else:
                    raise AssertionError("expected a 429 from the queue timeout")
            finally:
                await sdk.close()
            assert (await holder).status_code == 200
            assert gate.gateway.dispatcher.queued == 0


async def test_no_healthy_instance_fails_fast_with_503_and_recovers() -> None:
    configs = [EmulatorConfig(seed=i) for i in range(2)]
    async with run_fleet(configs) as fleet:
        settings = settings_for(fleet.urls, dispatch={"health_check_interval": 0.1, "unhealthy_after": 1})
        async with serve_gateway(settings) as gate, client() as http:
            assert (await complete(http, gate, "fine")).status_code == 200
            for inst in fleet.instances:
                inst.faults.unhealthy = True
            gw = gate.gateway
            await wait_until(lambda: not any(i.up for i in gw.fleet), what="every instance marked down")
            t0 = time.monotonic()
            r = await complete(http, gate, "anyone?")
            assert time.monotonic() - t0 < 1.0  # refused at once, not queued until a timeout
            _is_openai_error(r, 503, "no_instance")
            assert r.json()["error"]["type"] == "service_unavailable"
            assert (await http.get(gate.url + "/ready")).status_code == 503

            for inst in fleet.instances:
                inst.faults.unhealthy = False
            await wait_until(lambda: all(i.up for i in gw.fleet), what="instances back up")
            assert (await complete(http, gate, "back")).status_code == 200


async def _burst_on_slow_fleet(cap: int) -> tuple[int, int]:
    """A burst of 48 ~400-token requests on 4 instances, one 2.5x slow; the slow instance's peak
    in-flight (as its engine saw it) and how many requests it served."""
    configs = [EmulatorConfig(seed=i, slowdown=2.5 if i == 0 else 1.0) for i in range(4)]
    async with run_fleet(configs) as fleet:
        settings = settings_for(
            fleet.urls, dispatch={"max_queue_per_instance": cap, "prefix_affinity": False}
        )
        async with serve_gateway(settings) as gate, client() as http:
            slow = fleet.instances[0]
            watch = PeakWatch(lambda: [slow.book.in_flight, gate.gateway.fleet.get("i0").inflight])
            async with watch:
                burst = [complete(http, gate, words(400, seed=k), max_tokens=2) for k in range(48)]
                responses = await asyncio.gather(*burst)
            assert [r.status_code for r in responses] == [200] * 48
            assert gate.gateway.dispatcher.queued == 0
        return max(watch.peaks), served_counts(fleet)[0]


async def test_lowering_the_cap_moves_requests_away_from_a_deep_queue() -> None:
    deep_peak, deep_served = await _burst_on_slow_fleet(cap=32)
    capped_peak, capped_served = await _burst_on_slow_fleet(cap=8)
    assert capped_peak <= 8, capped_peak  # never deeper than the cap at the slow instance
    assert deep_peak > 8, deep_peak  # with the default cap the burst queued deep there
    assert capped_served < deep_served, (capped_served, deep_served)  # the work went elsewhere
