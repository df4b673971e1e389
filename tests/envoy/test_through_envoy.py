"""taogate as Envoy's endpoint picker: the SDKs through a real Envoy, the slow card learned and
avoided, a route's model rewrite, leases back after a client hangs up, refusals as immediate
responses in OpenAI's shape."""

from __future__ import annotations

import asyncio
import statistics
from collections import Counter

import anthropic
import httpx
import openai
import pytest

from taogate.bench.procs import free_port
from tests.conftest import KEY
from tests.envoy import stack
from tests.envoy.conftest import SLOW, TEAM_A_KEY, Stack
from tests.integration.dispatch_helpers import words

pytestmark = pytest.mark.asyncio(loop_scope="module")

MODEL = "emulated-model"


def _auth() -> dict[str, str]:
    return {"authorization": f"Bearer {KEY}"}


async def _idle(s: Stack) -> dict[str, dict[str, object]]:
    """The picker's rows once nothing is in flight (bounded poll: leases come back as streams end)."""
    for _ in range(200):
        rows = await stack.instances(s.picker)
        if all(r["inflight"] == 0 and r["prefill_tokens"] == 0 for r in rows.values()):
            return rows
        await asyncio.sleep(0.05)
    raise AssertionError(f"leases still held: {rows}")


async def test_openai_sdk_plain_and_streamed(envoy_stack: Stack) -> None:
    client = openai.AsyncOpenAI(base_url=envoy_stack.envoy.api_base, api_key=KEY, max_retries=0)
    messages = [{"role": "user", "content": "Say hello."}]
    raw = await client.chat.completions.with_raw_response.create(model=MODEL, messages=messages, max_tokens=8)  # type: ignore[arg-type]
    assert raw.headers["x-taogate-instance"].startswith("emu")
    answer = raw.parse()
    assert answer.choices[0].message.content and answer.usage is not None
    stream = await client.chat.completions.create(
        model=MODEL,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=8,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [c async for c in stream]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 8
    text = await client.completions.create(model=MODEL, prompt="Once upon", max_tokens=4)
    assert text.choices[0].text
    listed = await client.models.list()
    assert [m.id for m in listed.data] == [MODEL]
    await client.close()
    await _idle(envoy_stack)


async def test_anthropic_sdk_plain_and_streamed(envoy_stack: Stack) -> None:
    client = anthropic.AsyncAnthropic(base_url=envoy_stack.envoy.url, api_key=KEY, max_retries=0)
    message = await client.messages.create(
        model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "Say hello."}]
    )
    assert message.content and message.usage.output_tokens == 8
    async with client.messages.stream(
        model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "Say hello."}]
    ) as stream:
        text = "".join([t async for t in stream.text_stream])
        final = await stream.get_final_message()
    assert text and final.usage.output_tokens == 8
    wrong = anthropic.AsyncAnthropic(base_url=envoy_stack.envoy.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as refused:
        await wrong.messages.create(model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "hi"}])
    await wrong.close()
    assert refused.value.body["type"] == "error"  # type: ignore[index]  # Anthropic's error shape
    await client.close()


async def test_wrong_key_is_a_401_in_openai_shape_and_no_credentials_go_upstream(envoy_stack: Stack) -> None:
    async with httpx.AsyncClient(trust_env=False, timeout=10) as http:
        url = envoy_stack.envoy.api_base + "/chat/completions"
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        r = await http.post(url, json=body, headers={"authorization": "Bearer nope"})
        assert r.status_code == 401
        assert r.json()["error"]["code"] == "invalid_api_key"
        # The emulator echoes nothing of headers, but it refuses none either: the instance key path is
        # what serve's tests cover; here the client's key must be gone (Envoy would pass it on).
        r = await http.post(url, json=body, headers={**_auth(), "x-api-key": KEY})
        assert r.status_code == 200 and "x-taogate-instance" in r.headers


async def test_a_named_keys_limit_reaches_the_sdk_through_envoy(envoy_stack: Stack) -> None:
    """The OpenAI SDK behind Envoy reads the key's x-ratelimit-* headers, then raises its
    RateLimitError with OpenAI's code (two requests a minute)."""
    client = openai.AsyncOpenAI(base_url=envoy_stack.envoy.api_base, api_key=TEAM_A_KEY, max_retries=0)
    messages: list[openai.types.chat.ChatCompletionMessageParam] = [{"role": "user", "content": "hi"}]
    remaining = []
    for _ in range(2):
        raw = await client.chat.completions.with_raw_response.create(
            model=MODEL, messages=messages, max_tokens=2
        )
        assert raw.parse().choices[0].message.content
        remaining.append(raw.headers["x-ratelimit-remaining-requests"])
    assert remaining == ["1", "0"]
    with pytest.raises(openai.RateLimitError) as refused:
        await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
    assert refused.value.code == "rate_limit_exceeded"
    assert int(refused.value.response.headers["retry-after"]) >= 1
    await client.close()


async def test_slow_instance_gets_less_work_and_is_flagged(envoy_stack: Stack) -> None:
    """Prefill dominates (1,500-token prompts, 2 output tokens): the slow card is learned from the
    TTFTs seen through ext_proc and gets a small share, as under ``serve``."""
    client = openai.AsyncOpenAI(base_url=envoy_stack.envoy.api_base, api_key=KEY, max_retries=0)
    served: Counter[str] = Counter()
    slots = asyncio.Semaphore(6)

    async def one(k: int) -> None:
        async with slots:
            raw = await client.chat.completions.with_raw_response.create(
                model=MODEL,
                messages=[{"role": "user", "content": words(1_500, seed=1000 + k)}],
                max_tokens=2,
                stream=True,
            )
            served[raw.headers["x-taogate-instance"]] += 1
            async for _ in raw.parse():
                pass

    await asyncio.gather(*(one(k) for k in range(48)))
    await client.close()
    rows = await _idle(envoy_stack)
    fast_mean = statistics.mean(served[f"emu{i}"] for i in range(3) if i != SLOW)
    assert served[f"emu{SLOW}"] < 0.6 * fast_mean, served
    for _ in range(100):  # the flag follows the learned speeds (bounded poll: it is re-judged in time)
        if rows[f"emu{SLOW}"]["slow"]:
            break
        await asyncio.sleep(0.1)
        rows = await stack.instances(envoy_stack.picker)
    assert rows[f"emu{SLOW}"]["slow"] is True, rows
    assert all(not rows[f"emu{i}"]["slow"] for i in range(3) if i != SLOW), rows


async def test_a_routes_model_rewrite_reaches_the_instance(envoy_stack: Stack) -> None:
    """The Inference Extension's rewrite header, as an HTTPRoute would set it: the picker writes
    that model into the body Envoy forwards, so a name no instance serves is answered by the one
    serving the rewrite; a malformed name is refused in OpenAI's shape."""
    url = envoy_stack.envoy.api_base + "/chat/completions"
    body = {"model": "alias-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    rewrite = "x-gateway-model-name-rewrite"
    async with httpx.AsyncClient(trust_env=False, timeout=10, headers=_auth()) as http:
        unknown = await http.post(url, json=body)
        rewritten = await http.post(url, json=body, headers={rewrite: MODEL})
        malformed = await http.post(url, json=body, headers={rewrite: "two words"})
    assert unknown.status_code == 404, unknown.text
    assert rewritten.status_code == 200 and rewritten.json()["model"] == MODEL, rewritten.text
    assert malformed.status_code == 400 and malformed.json()["error"]["code"] == "invalid_model"
    await _idle(envoy_stack)


async def test_an_envoy_set_up_for_llm_d_routes_by_the_pick_not_by_the_client(envoy_stack: Stack) -> None:
    """An Envoy whose cluster routes by llm-d's router's name for the destination finds the pick
    there, and a destination the client sends under that name (a closed port here) is overwritten:
    the request reaches an instance."""
    name = "x-llm-d-router-destination-endpoint"
    doc = stack.bootstrap(free_port(), free_port(), [envoy_stack.picker.port])
    cluster = next(c for c in doc["static_resources"]["clusters"] if "original_dst_lb_config" in c)
    cluster["original_dst_lb_config"]["http_header_name"] = name
    async with (
        stack.envoy(envoy_stack.workdir, doc, name="envoy-llm-d") as envoy,
        openai.AsyncOpenAI(base_url=envoy.api_base, api_key=KEY, max_retries=0, timeout=10) as client,
    ):
        plain = await client.completions.with_raw_response.create(model=MODEL, prompt="hi", max_tokens=2)
        spoofed = await client.completions.with_raw_response.create(
            model=MODEL, prompt="hi", max_tokens=2, extra_headers={name: f"127.0.0.1:{free_port()}"}
        )
    for raw in (plain, spoofed):
        assert raw.status_code == 200 and raw.headers["x-taogate-instance"].startswith("emu")
    await _idle(envoy_stack)


async def test_a_base_url_path_is_taken_off_before_the_instance_as_serve_does(envoy_stack: Stack) -> None:
    """With ``base_url`` under a path, clients call ``/api/v1/...``; the instance serves ``/v1/...``:
    the pick sets the path it forwards, or vLLM would answer 404."""
    config = envoy_stack.workdir / "prefixed.toml"
    stack.write_config(config, envoy_stack.fleet.urls, base_url="http://127.0.0.1:8080/api")
    async with stack.picker(envoy_stack.workdir, config, name="picker-prefixed") as picker:
        doc = stack.bootstrap(free_port(), free_port(), [picker.port])
        async with (
            stack.envoy(envoy_stack.workdir, doc, name="envoy-prefixed") as envoy,
            openai.AsyncOpenAI(
                base_url=envoy.url + "/api/v1", api_key=KEY, max_retries=0, timeout=10
            ) as client,
        ):
            raw = await client.completions.with_raw_response.create(model=MODEL, prompt="hi", max_tokens=2)
            chat = await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2
            )
    assert raw.status_code == 200 and raw.headers["x-taogate-instance"].startswith("emu")
    assert chat.choices[0].message.content is not None


async def test_an_envoy_sending_bodies_buffered_gets_a_clear_500_not_a_hang(envoy_stack: Stack) -> None:
    """The picker reads the body to pick; in BUFFERED mode Envoy waits for the headers' answer
    before it sends the body: without the announced mode looked at, both sides wait."""
    mode = {
        "request_header_mode": "SEND",
        "response_header_mode": "SEND",
        "request_body_mode": "BUFFERED",
        "response_body_mode": "NONE",
    }
    doc = stack.bootstrap(free_port(), free_port(), [envoy_stack.picker.port], processing_mode=mode)
    async with (
        stack.envoy(envoy_stack.workdir, doc, name="envoy-buffered") as envoy,
        httpx.AsyncClient(timeout=10) as http,
    ):
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
        r = await http.post(envoy.api_base + "/completions", json=body, headers=_auth())
    assert r.status_code == 500, r.text
    error = r.json()["error"]
    assert error["code"] == "picker_body_mode" and "FULL_DUPLEX_STREAMED" in error["message"]
    await _idle(envoy_stack)


async def test_client_that_hangs_up_gives_its_lease_back(envoy_stack: Stack) -> None:
    async with httpx.AsyncClient(trust_env=False, timeout=10) as http:
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "go on"}],
            "max_tokens": 2000,
            "stream": True,
        }
        async with http.stream(
            "POST", envoy_stack.envoy.api_base + "/chat/completions", json=body, headers=_auth()
        ) as r:
            assert r.status_code == 200
            name = r.headers["x-taogate-instance"]
            async for _ in r.aiter_raw():
                break  # one chunk in, then the client goes away mid-stream
        rows = await stack.instances(envoy_stack.picker)
        assert rows[name]["inflight"] <= 1
    await _idle(envoy_stack)


async def test_drained_fleet_is_a_503_immediate_response(envoy_stack: Stack) -> None:
    async with httpx.AsyncClient(trust_env=False, timeout=10) as http:
        admin = envoy_stack.picker.http + "/admin/instances/{}/{}"
        for i in range(3):
            assert (await http.post(admin.format(f"emu{i}", "drain"), headers=_auth())).status_code == 200
        try:
            body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
            r = await http.post(envoy_stack.envoy.api_base + "/chat/completions", json=body, headers=_auth())
            assert r.status_code == 503
            assert r.json()["error"]["code"] == "no_instance" and "retry-after" in r.headers
        finally:
            for i in range(3):
                await http.post(admin.format(f"emu{i}", "undrain"), headers=_auth())
