"""Faults: switchable at start, in-process and over HTTP; each observable the way a client would see it."""

from __future__ import annotations

import time

import httpx
import openai
import pytest

from taogate.emulator import Faults, run_fleet
from tests.conftest import wait_until

from .emulator_helpers import fast_config


async def test_unhealthy_and_faults_over_http() -> None:
    fleet_ctx = run_fleet([fast_config(faults=Faults(unhealthy=True))])
    async with fleet_ctx as fleet, httpx.AsyncClient(base_url=fleet.urls[0]) as http:
        assert (await http.get("/health")).status_code == 503
        updated = (
            await http.post("/emulator/faults", json={"unhealthy": False, "latency_spike": 0.5})
        ).json()
        assert updated["unhealthy"] is False and updated["latency_spike"] == 0.5
        assert (await http.get("/health")).status_code == 200
        assert (await http.get("/emulator/faults")).json() == fleet.instances[0].faults.as_dict()
        bad = await http.post("/emulator/faults", json={"explode": True})
        assert bad.status_code == 400 and "unknown fault" in bad.json()["error"]["message"]
        fleet.instances[0].faults.unhealthy = True  # in-process switch
        assert (await http.get("/health")).status_code == 503


async def test_error_rate_one_answers_500_in_vllm_shape() -> None:
    async with run_fleet([fast_config(faults=Faults(error_rate=1.0))]) as fleet:
        async with openai.AsyncOpenAI(base_url=fleet.urls[0] + "/v1", api_key="x", max_retries=0) as client:
            with pytest.raises(openai.InternalServerError) as info:
                await client.completions.create(model="emulated-model", prompt="x")
        assert info.value.status_code == 500
        error = info.value.body
        assert isinstance(error, dict) and error["code"] == 500 and error["type"] == "InternalServerError"
        assert fleet.instances[0].stats()["errors"] == 1


async def test_close_mid_stream_breaks_the_stream() -> None:
    async with run_fleet([fast_config(faults=Faults(close_mid_stream=2))]) as fleet:
        inst = fleet.instances[0]
        body = {"prompt": "x", "max_tokens": 50, "stream": True}
        async with httpx.AsyncClient(base_url=fleet.urls[0]) as http:
            received: list[str] = []
            with pytest.raises(httpx.RemoteProtocolError):
                async with http.stream("POST", "/v1/completions", json=body) as response:
                    received.extend([line async for line in response.aiter_lines() if line])
            assert "data: [DONE]" not in received
        await wait_until(lambda: inst.stats()["in_flight"] == 0)
        assert inst.engine.num_running == 0 and inst.stats()["aborted"] == 1


async def test_hang_never_answers_and_does_not_leak() -> None:
    async with run_fleet([fast_config(faults=Faults(hang=True))]) as fleet:
        inst = fleet.instances[0]
        async with httpx.AsyncClient(base_url=fleet.urls[0], timeout=0.2) as http:
            with pytest.raises(httpx.ReadTimeout):
                await http.post(
                    "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}
                )
            assert (await http.get("/health")).status_code == 200  # alive, just not answering
        await wait_until(lambda: inst.stats()["in_flight"] == 0)
        assert inst.stats()["aborted"] == 1 and inst.engine.has_work() is False


async def test_slow_first_byte_and_latency_spike() -> None:
    fleet_ctx = run_fleet([fast_config(faults=Faults(slow_first_byte=0.2))])
    async with fleet_ctx as fleet, httpx.AsyncClient(base_url=fleet.urls[0]) as http:
        body = {"prompt": "x", "max_tokens": 2}
        start = time.perf_counter()
        assert (await http.post("/v1/completions", json=body)).status_code == 200
        assert time.perf_counter() - start >= 0.2
        fleet.instances[0].faults.merge({"slow_first_byte": 0, "latency_spike": 0.05})
        start = time.perf_counter()
        await http.post("/v1/completions", json=body)
        assert time.perf_counter() - start >= 2 * 0.05  # two steps, each spiked


async def test_instant_mode_keeps_the_shapes() -> None:
    async with run_fleet([fast_config(instant=True, step_overhead=10.0)]) as fleet:
        async with openai.AsyncOpenAI(base_url=fleet.urls[0] + "/v1", api_key="x", max_retries=0) as client:
            start = time.perf_counter()
            done = await client.completions.create(model="emulated-model", prompt="a b", max_tokens=4)
            stream = await client.chat.completions.create(
                model="emulated-model",
                messages=[{"role": "user", "content": "hi"}],
                max_tokens=3,
                stream=True,
                stream_options={"include_usage": True},
            )
            chunks = [c async for c in stream]
            emb = await client.embeddings.create(model="emulated-model", input="a")
            assert time.perf_counter() - start < 2.0  # 10 s steps would show if the engine ran
        assert done.usage is not None and done.usage.completion_tokens == 4
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 3
        assert len(emb.data[0].embedding) == 64
