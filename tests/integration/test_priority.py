"""Priority classes end to end: the gateway queue behind cap-limited instances, what priority
instances are told, and the class in the access log and the metrics."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import httpx
import orjson
import pytest

from taogate.app import serve_gateway
from taogate.emulator.config import EmulatorConfig
from taogate.serving import serve_asgi
from tests.conftest import KEY, GatewayFactory, gateway_settings, wait_until
from tests.integration.recording import Upstream

AUTH = {"authorization": f"Bearer {KEY}"}
MODEL = "emulated-model"
# Each request holds its instance for a dozen engine steps, so the queue really forms.
SLOW = EmulatorConfig(decode_tokens_per_s=200.0)


def chat(priority: int | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 12}
    if priority is not None:
        body["priority"] = priority
    return body


async def test_urgent_requests_after_ten_batch_ones_finish_among_the_first_four(
    gateway_factory: GatewayFactory,
) -> None:
    async with gateway_factory([SLOW, SLOW], dispatch={"max_queue_per_instance": 1}) as gw:
        done: list[str] = []

        async def send(http: httpx.AsyncClient, name: str, **kwargs: Any) -> None:
            reply = await http.post(gw.api_base + "/chat/completions", **kwargs)
            assert reply.status_code == 200, reply.text
            done.append(name)

        async with httpx.AsyncClient(timeout=60, headers=AUTH) as http:
            batch = [asyncio.create_task(send(http, f"batch{i}", json=chat(5))) for i in range(10)]
            await wait_until(lambda: gw.gateway.dispatcher.queued == 8, what="eight batch requests queued")
            urgent = [
                asyncio.create_task(send(http, "urgent-body", json=chat(0))),
                asyncio.create_task(send(http, "urgent-header", json=chat(), headers={"x-priority": "0"})),
            ]
            await asyncio.gather(*batch, *urgent)
        assert {"urgent-body", "urgent-header"} <= set(done[:4]), done


async def test_a_sustained_urgent_flood_still_lets_batch_requests_through(
    gateway_factory: GatewayFactory,
) -> None:
    async with gateway_factory([SLOW], dispatch={"max_queue_per_instance": 1, "oldest_every": 4}) as gw:
        done: list[str] = []
        flooding = True

        async def flood(http: httpx.AsyncClient) -> None:
            while flooding:
                reply = await http.post(gw.api_base + "/chat/completions", json=chat(0))
                assert reply.status_code == 200
                done.append("urgent")

        async def batch(http: httpx.AsyncClient) -> None:
            reply = await http.post(
                gw.api_base + "/chat/completions", json=chat(), headers={"x-priority": "5"}
            )
            assert reply.status_code == 200
            done.append("batch")

        async with httpx.AsyncClient(timeout=60, headers=AUTH) as http:
            floods = [asyncio.create_task(flood(http)) for _ in range(6)]
            await wait_until(lambda: gw.gateway.dispatcher.queued == 5, what="the flood queued")
            batches = [asyncio.create_task(batch(http)) for _ in range(3)]
            await asyncio.wait_for(asyncio.gather(*batches), 30)
            flooding = False
            await asyncio.gather(*floods)
        last = max(i for i, name in enumerate(done) if name == "batch")
        # Queued behind five urgent requests, then one slot in every four: never starved.
        assert last < 1 + 5 + 3 * 4 + 2, done


async def test_only_priority_instances_are_told_the_class(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="taogate.access")
    told, fcfs = Upstream("ranked"), Upstream("plain")
    lines: list[str] = []
    async with serve_asgi(told) as a, serve_asgi(fcfs) as b:
        settings = gateway_settings([a.url, b.url], dispatch={"scrape_interval": 0})
        settings.instances[0].scheduling_policy = "priority"
        async with serve_gateway(settings, key=KEY, access_sink=lines.append) as gw:
            await wait_until(lambda: all(i.models for i in gw.gateway.fleet), what="models learned")
            async with httpx.AsyncClient(timeout=30, headers=AUTH) as http:
                for model, upstream in (("ranked", told), ("plain", fcfs)):
                    body = orjson.dumps({"model": model, "messages": [], "priority": 1})
                    headers = {"x-priority": "3", "x-vllm-priority": "9", "content-type": "application/json"}
                    await http.post(gw.url + "/v1/chat/completions", content=body, headers=headers)
                    seen = upstream.seen[-1]
                    assert "x-vllm-priority" not in seen.headers and "x-priority" not in seen.headers
                    expected = body[:-1] + b',"priority":3}' if upstream is told else body
                    assert seen.body == expected
                    anthropic = {"model": model, "messages": [], "max_tokens": 1, "priority": 2}
                    await http.post(gw.url + "/v1/messages", json=anthropic)
                    header = upstream.seen[-1].headers.get("x-vllm-priority")
                    assert header == ("2" if upstream is told else None)
                metrics = (await http.get(gw.url + "/metrics")).text
    assert sum("priority=3" in line for line in lines) == 2
    assert 'taogate_priority_requests_total{priority="3",status_class="2xx"} 2.0' in metrics
    assert 'taogate_priority_requests_total{priority="2",status_class="2xx"} 2.0' in metrics
