"""The real Anthropic SDK → the gateway → emulated vLLM instances serving ``/v1/messages``."""

from __future__ import annotations

import asyncio

import anthropic
import httpx
import pytest

from taogate.emulator.config import EmulatorConfig
from tests.conftest import KEY, GatewayFactory, Running

MODEL = "emulated-model"
HELLO = [{"role": "user", "content": "hello there"}]


def client(gw: Running, base: str = "", **kwargs: str) -> anthropic.AsyncAnthropic:
    auth = kwargs or {"api_key": KEY}
    return anthropic.AsyncAnthropic(base_url=gw.url + base, max_retries=0, timeout=30, **auth)  # type: ignore[arg-type]


async def test_sync_sdk_under_both_roots_with_either_credential(gw: Running) -> None:
    def run() -> None:
        for base in ("", "/api"):
            for auth in ({"api_key": KEY}, {"auth_token": KEY}):
                sdk = anthropic.Anthropic(base_url=gw.url + base, max_retries=0, timeout=30, **auth)  # type: ignore[arg-type]
                reply = sdk.messages.create(model=MODEL, max_tokens=5, system="Be brief.", messages=HELLO)
                assert reply.type == "message" and reply.role == "assistant"
                assert reply.content[0].type == "text" and reply.content[0].text
                assert reply.stop_reason == "max_tokens" and reply.usage.output_tokens == 5
                sdk.close()

    await asyncio.to_thread(run)


async def test_async_sdk_streams_text_and_the_final_usage(gw: Running) -> None:
    async with client(gw) as sdk:
        async with sdk.messages.stream(model=MODEL, max_tokens=6, messages=HELLO) as stream:
            pieces = [text async for text in stream.text_stream]
            final = await stream.get_final_message()
        counted = await sdk.messages.count_tokens(model=MODEL, messages=HELLO)
    assert len(pieces) == 6 and "".join(pieces) == final.content[0].text  # type: ignore[union-attr]
    assert final.usage.output_tokens == 6 and final.usage.input_tokens > 0
    assert counted.input_tokens > 0


async def test_the_request_id_is_under_the_header_the_anthropic_sdk_reads(gw: Running) -> None:
    async with client(gw) as sdk:
        raw = await sdk.messages.with_raw_response.create(model=MODEL, max_tokens=3, messages=HELLO)
        reply = await raw.parse()
    assert raw.headers["request-id"] == raw.headers["x-request-id"]
    assert reply._request_id == raw.headers["x-request-id"]


async def test_claude_code_s_x_api_key_and_beta_query_are_accepted(gw: Running) -> None:
    """Claude Code sends ANTHROPIC_API_KEY as x-api-key and posts to /v1/messages?beta=true."""
    body = {"model": MODEL, "max_tokens": 3, "messages": HELLO, "stream": True}
    headers = {"x-api-key": KEY, "anthropic-version": "2023-06-01", "anthropic-beta": "tools-2024"}
    async with httpx.AsyncClient(timeout=30) as http:
        reply = await http.post(gw.url + "/v1/messages?beta=true", json=body, headers=headers)
        assert reply.status_code == 200, reply.text
        events = [line.split(": ", 1)[1] for line in reply.text.splitlines() if line.startswith("event: ")]
        assert events[0] == "message_start" and events[-2:] == ["message_delta", "message_stop"]
        assert "ping" not in events and events.count("content_block_delta") == 3
        # On the OpenAI routes the key is still a bearer token only.
        chat = {"model": MODEL, "max_tokens": 3, "messages": HELLO}
        refused = await http.post(gw.url + "/v1/chat/completions", json=chat, headers={"x-api-key": KEY})
        assert refused.status_code == 401 and refused.json()["error"]["type"] == "authentication_error"


async def test_gateway_errors_take_anthropic_s_shape_and_status(gw: Running) -> None:
    with pytest.raises(anthropic.AuthenticationError) as denied:
        async with client(gw, api_key="wrong") as sdk:
            await sdk.messages.create(model=MODEL, max_tokens=3, messages=HELLO)
    message = "Incorrect API key: taogate accepts only its unified key."
    assert denied.value.request_id  # the SDK's own header, request-id, on the gateway's errors too
    assert denied.value.body == {
        "type": "error",
        "error": {"type": "authentication_error", "message": message},
    }
    with pytest.raises(anthropic.NotFoundError) as missing:
        async with client(gw) as sdk:
            await sdk.messages.create(model="no-such-model", max_tokens=3, messages=HELLO)
    assert missing.value.type == "not_found_error"  # type: ignore[attr-defined]
    async with httpx.AsyncClient(timeout=30) as http:
        bad = await http.post(
            gw.url + "/v1/messages", content=b"{not json", headers={"authorization": f"Bearer {KEY}"}
        )
    assert bad.status_code == 400
    assert bad.json()["type"] == "error" and bad.json()["error"]["type"] == "invalid_request_error"


async def test_errors_outside_the_routes_take_anthropic_s_shape_on_its_paths(gw: Running) -> None:
    """An unserved path under /v1/messages, a wrong method, a head refused by the listener: each in
    the shape the Anthropic SDK reads; the same refusal on an OpenAI route stays in OpenAI's."""
    for base in ("", "/api"):
        with pytest.raises(anthropic.NotFoundError) as missing:
            async with client(gw, base) as sdk:
                await sdk.messages.batches.list()
        assert missing.value.type == "not_found_error"  # type: ignore[attr-defined]
        assert "Unknown path" in missing.value.message
    huge = {"authorization": f"Bearer {KEY}", "x-filler": "a" * 70_000}
    async with httpx.AsyncClient(timeout=30) as http:
        wrong = await http.get(gw.url + "/v1/messages", headers={"authorization": f"Bearer {KEY}"})
        assert wrong.status_code == 405 and wrong.json()["error"]["type"] == "invalid_request_error"
        assert wrong.json()["type"] == "error"
        refused = await http.post(gw.url + "/v1/messages?beta=true", json={}, headers=huge)
        assert refused.status_code == 431 and refused.json()["type"] == "error", refused.text
        assert "exceeds" in refused.json()["error"]["message"]
        long_url = await http.post(gw.url + "/v1/messages?q=" + "a" * 9000, json={}, headers=huge)
        assert long_url.status_code == 414 and long_url.json()["type"] == "error", long_url.text
        openai = await http.post(gw.url + "/v1/chat/completions", json={}, headers=huge)
        assert openai.status_code == 431 and openai.json()["error"]["code"] == "header_too_large"


async def test_usage_in_anthropic_fields_reaches_metrics_and_learning(
    gateway_factory: GatewayFactory,
) -> None:
    # vLLM reports cache hits (Anthropic's cache_read_input_tokens too) only with this flag.
    config = EmulatorConfig(enable_prefix_caching=True, enable_prompt_tokens_details=True)
    async with gateway_factory([config]) as gw:
        system = "You answer questions about the fleet. " * 40
        async with client(gw) as sdk:
            for _ in range(3):
                reply = await sdk.messages.create(model=MODEL, max_tokens=4, system=system, messages=HELLO)
        # A repeated prompt is served from the prefix cache: Anthropic counts those tokens apart.
        usage = reply.usage
        assert usage.cache_read_input_tokens and usage.cache_read_input_tokens > 0
        total = usage.input_tokens + usage.cache_read_input_tokens
        async with httpx.AsyncClient(timeout=30) as http:
            metrics = (await http.get(gw.url + "/metrics")).text
        line = next(
            m for m in metrics.splitlines() if m.startswith("taogate_prompt_tokens_total{") and "usage" in m
        )
        assert float(line.rsplit(" ", 1)[1]) == 3 * total
        assert gw.gateway.accounting.tokens.observations(MODEL) == 3


async def test_a_stream_broken_mid_way_ends_with_an_anthropic_error_event(
    gateway_factory: GatewayFactory,
) -> None:
    configs = [EmulatorConfig()]
    async with gateway_factory(configs) as gw:
        gw.fleet.instances[0].faults.merge({"close_mid_stream": 2})
        with pytest.raises(anthropic.APIStatusError) as broken:
            async with (
                client(gw) as sdk,
                sdk.messages.stream(model=MODEL, max_tokens=8, messages=HELLO) as stream,
            ):
                async for _ in stream.text_stream:
                    pass
        assert broken.value.type == "api_error"  # type: ignore[attr-defined]
