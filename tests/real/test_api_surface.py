"""The gateway's wider API surface in front of the real pair: the Anthropic SDK on /v1/messages,
chained stored Responses, vLLM's other routes and priority classes."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import anthropic
import httpx
import openai
import pytest

from taogate.app import RunningGateway, serve_gateway
from taogate.settings import Settings
from tests.real.conftest import Pair

KEY = "real-tier-key"
HELLO = [{"role": "user", "content": "Hello there, how are you?"}]


@pytest.fixture
async def gw(vllm_pair: Pair) -> AsyncIterator[RunningGateway]:
    settings = Settings(
        gateway={"base_url": "http://127.0.0.1:8080", "host": "127.0.0.1", "shutdown_timeout": 5},
        dispatch={"warmup_tokens": 0},
        instances=[{"url": s.url, "name": s.spec.label} for s in vllm_pair.servers],
    )
    async with serve_gateway(settings, key=KEY) as running:
        yield running


async def test_the_anthropic_sdk_sync_async_and_streaming(gw: RunningGateway, vllm_pair: Pair) -> None:
    model = vllm_pair.model

    def sync() -> anthropic.types.Message:
        with anthropic.Anthropic(base_url=gw.url, api_key=KEY, max_retries=0) as sdk:
            return sdk.messages.create(model=model, max_tokens=6, system="Be brief.", messages=HELLO)  # type: ignore[arg-type]

    reply = await asyncio.to_thread(sync)
    assert reply.type == "message" and reply.id.startswith("chatcmpl-")
    assert reply.usage.input_tokens > 5 and reply.usage.output_tokens >= 1
    async with anthropic.AsyncAnthropic(base_url=gw.url, auth_token=KEY, max_retries=0) as sdk:
        async with sdk.messages.stream(model=model, max_tokens=6, messages=HELLO) as stream:  # type: ignore[arg-type]
            async for _ in stream.text_stream:
                pass
            final = await stream.get_final_message()
        assert final.usage.output_tokens >= 1 and final.usage.input_tokens > 5
        counted = await sdk.messages.count_tokens(model=model, messages=HELLO)  # type: ignore[arg-type]
        assert counted.input_tokens > 5
        with pytest.raises(anthropic.NotFoundError):
            await sdk.messages.create(model="claude-sonnet-4", max_tokens=4, messages=HELLO)  # type: ignore[arg-type]
    # What the gateway learned from the Anthropic usage fields: the prompt size of each card.
    assert gw.gateway.accounting.tokens.observations(model) >= 2


async def test_six_chained_responses_on_the_real_store(gw: RunningGateway, vllm_pair: Pair) -> None:
    async with openai.AsyncOpenAI(base_url=gw.api_base, api_key=KEY, max_retries=0, timeout=60) as client:
        previous: str | None = None
        served: set[str] = set()
        for turn in range(6):
            raw = await client.responses.with_raw_response.create(
                model=vllm_pair.model,
                input=f"Turn {turn}.",
                max_output_tokens=3,
                previous_response_id=previous,
            )
            reply = raw.parse()
            assert reply.status == "incomplete" and reply.output, reply  # three tokens: cut short
            served.add(raw.headers["x-taogate-instance"])
            previous = reply.id
        assert len(served) == 1 and previous is not None
        assert (await client.responses.retrieve(previous)).id == previous


async def test_vllm_s_other_routes(gw: RunningGateway, vllm_pair: Pair) -> None:
    auth = {"authorization": f"Bearer {KEY}"}
    body: dict[str, Any] = {"model": vllm_pair.model, "max_tokens": 3, "temperature": 0}
    async with httpx.AsyncClient(timeout=60, headers=auth) as http:
        version = (await http.get(gw.url + "/version")).json()
        assert version["version"] == "0.32.0" and set(version["instances"]) == {"fast", "slow"}
        assert (await http.get(gw.url + "/ping")).status_code == 200
        load = (await http.get(gw.url + "/load")).json()
        assert load["server_load"] == 0 and set(load["instances"]) == {"fast", "slow"}
        score = await http.post(
            gw.url + "/score", json={"model": vllm_pair.model, "text_1": "a", "text_2": "b"}
        )
        assert score.status_code == 404 and score.json() == {"detail": "Not Found"}  # a generative model
        batch = {
            **body,
            "messages": [[{"role": "user", "content": "Hi"}], [{"role": "user", "content": "Yo"}]],
        }
        answer = await http.post(gw.url + "/v1/chat/completions/batch", json=batch)
        assert answer.status_code == 200 and len(answer.json()["choices"]) == 2
        invoked = await http.post(gw.url + "/invocations", json={**body, "prompt": "Once upon"})
        assert invoked.status_code == 200 and invoked.json()["object"] == "text_completion"
        # A priority on first-come-first-served instances is accepted and has no effect there.
        chat = {**body, "messages": HELLO, "priority": 5}
        ranked = await http.post(gw.url + "/v1/chat/completions", json=chat, headers={"x-priority": "1"})
        assert ranked.status_code == 200
