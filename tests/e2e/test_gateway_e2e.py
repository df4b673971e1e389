"""The real OpenAI SDK → the gateway → emulated vLLM instances, all on 127.0.0.1."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest

from taogate.emulator.config import EmulatorConfig
from tests.conftest import KEY, GatewayFactory, Running

MODEL = "emulated-model"


def sync_client(gw: Running, base: str = "/v1", key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url + base, api_key=key, max_retries=0, timeout=30)


def async_client(gw: Running, base: str = "/v1") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=gw.url + base, api_key=KEY, max_retries=0, timeout=30)


async def test_sync_sdk_chat_and_completions_under_both_prefixes(gw: Running) -> None:
    def run() -> None:
        for base in ("/v1", "/api/v1"):
            client = sync_client(gw, base)
            chat = client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hello there"}], max_tokens=5
            )
            assert chat.choices[0].message.content
            assert chat.usage is not None and chat.usage.completion_tokens == 5
            comp = client.completions.create(model=MODEL, prompt="once upon a time", max_tokens=3)
            assert comp.choices[0].text and comp.usage is not None and comp.usage.completion_tokens == 3
            client.close()

    await asyncio.to_thread(run)


async def test_async_sdk_streams_chat_and_completions(gw: Running) -> None:
    client = async_client(gw)
    stream = await client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "count"}],
        max_tokens=6,
        stream=True,
        stream_options={"include_usage": True},
    )
    text = ""
    usage = None
    async for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
        if chunk.usage is not None:
            usage = chunk.usage
    assert text and usage is not None and usage.completion_tokens == 6
    cstream = await client.completions.create(model=MODEL, prompt="abc", max_tokens=4, stream=True)
    pieces = [c.choices[0].text async for c in cstream if c.choices]
    assert len("".join(pieces)) > 0
    await client.close()


async def test_a_stream_that_asked_no_usage_is_counted_and_shows_none(gw: Running) -> None:
    """The SDK's default stream asks vLLM for no usage, so its tokens were counted nowhere. The
    gateway asks for it, counts it, and keeps the usage-only chunk from the client, whose code
    reads ``choices[0]`` of every chunk."""

    async def counted() -> float:
        async with httpx.AsyncClient(timeout=30) as http:
            text = (await http.get(gw.url + "/metrics")).text
        lines = [line for line in text.splitlines() if line.startswith("taogate_completion_tokens_total")]
        return sum(float(line.rsplit(" ", 1)[1]) for line in lines)

    before = await counted()
    async with async_client(gw) as client:
        stream = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "count"}], max_tokens=6, stream=True
        )
        chunks = [chunk async for chunk in stream]
        cstream = await client.completions.create(model=MODEL, prompt="abc", max_tokens=4, stream=True)
        pieces = [c.choices[0].text async for c in cstream]  # every chunk has a choice
        declined = await client.completions.create(
            model=MODEL, prompt="abc", max_tokens=3, stream=True, stream_options={"include_usage": False}
        )
        no_usage = [c async for c in declined]  # declining it does not take it off the key's count
    assert chunks and all(c.choices and c.usage is None for c in chunks)
    assert "".join(pieces) and all(c.choices and c.usage is None for c in no_usage)
    assert await counted() - before == 6 + 4 + 3


async def test_embeddings_models_and_tokenize(gw: Running) -> None:
    client = async_client(gw)
    emb = await client.embeddings.create(model=MODEL, input=["a b c", "d e"])
    assert len(emb.data) == 2 and len(emb.data[0].embedding) > 0
    models = await client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    await client.close()
    async with httpx.AsyncClient(headers={"authorization": f"Bearer {KEY}"}) as h:
        r = await h.post(gw.url + "/tokenize", json={"prompt": "hello world"})
        assert r.status_code == 200 and r.json()["count"] > 0
        r = await h.post(gw.url + "/api/tokenize", json={"model": MODEL, "prompt": "hello"})
        assert r.status_code == 200


async def test_auth_failures_are_openai_shaped_401(gw: Running) -> None:
    client = openai.AsyncOpenAI(base_url=gw.api_base, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}])
    assert e.value.status_code == 401
    body = e.value.body
    assert isinstance(body, dict) and body["type"] == "authentication_error"
    await client.close()
    async with httpx.AsyncClient() as h:
        r = await h.post(gw.api_base + "/chat/completions", json={"model": MODEL})
        assert r.status_code == 401 and set(r.json()["error"]) == {"message", "type", "param", "code"}
        r = await h.get(gw.api_base + "/models")
        assert r.status_code == 401
        metrics = (await h.get(gw.url + "/metrics")).text
    assert 'taogate_rejections_total{reason="auth"} 3.0' in metrics


async def test_bad_input_gets_clear_errors_and_leaks_nothing(gw: Running) -> None:
    auth = {"authorization": f"Bearer {KEY}"}
    async with httpx.AsyncClient(headers=auth, timeout=10) as h:
        r = await h.post(gw.api_base + "/chat/completions", content=b"{not json")
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
        r = await h.post(gw.api_base + "/chat/completions", content=b"[1, 2]")
        assert r.status_code == 400
        r = await h.post(gw.api_base + "/chat/completions", json={"messages": []})
        assert r.status_code == 400 and r.json()["error"]["param"] == "model"
        r = await h.post(gw.api_base + "/chat/completions", json={"model": "nope", "messages": []})
        err = r.json()["error"]
        assert r.status_code == 404 and err["code"] == "model_not_found" and MODEL in err["message"]
        big = b'{"model": "emulated-model", "prompt": "' + b"x" * (33 * 1024 * 1024) + b'"}'
        r = await h.post(gw.api_base + "/completions", content=big)
        assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"
        r = await h.get(gw.api_base + "/chat/completions")
        assert r.status_code == 405 and r.json()["error"]["type"] == "invalid_request_error"
        r = await h.get(gw.url + "/v2/whatever")
        assert r.status_code == 404 and "/v1" in r.json()["error"]["message"]
        # The emulator's own 400 (prompt too long) passes through unchanged.
        r = await h.post(gw.api_base + "/completions", json={"model": MODEL, "prompt": [1] * 40_000})
        assert r.status_code == 400 and r.json()["error"]["code"] == 400
    assert all(i.inflight == 0 and i.prefill_tokens == 0 for i in gw.gateway.fleet)


async def test_request_id_tag_and_instance_headers(gw: Running) -> None:
    headers = {"authorization": f"Bearer {KEY}", "x-request-tag": "prefill-bench"}
    async with httpx.AsyncClient(headers=headers, timeout=30) as h:
        r = await h.post(
            gw.api_base + "/completions",
            json={"model": MODEL, "prompt": "hi", "max_tokens": 2},
            headers={"x-request-id": "abc-123"},
        )
        assert r.status_code == 200
        assert r.headers["x-request-id"] == "abc-123"
        served_by = r.headers["x-taogate-instance"]
        long_prompt = "This is a long text used to test prefill performance. " * 500
        r = await h.post(
            gw.api_base + "/completions", json={"model": MODEL, "prompt": long_prompt, "max_tokens": 2}
        )
        assert r.status_code == 200
    seen = [rec for inst in gw.fleet.instances for rec in inst.stats()["records"]]
    by_id = {rec["id"]: rec for rec in seen}
    assert by_id["abc-123"]["tag"] == "prefill-bench"
    assert served_by in {"i0", "i1"}
    long_tags = [rec["tag"] for rec in seen if rec["prompt_tokens"] > 4096]
    assert long_tags == ["prefill-bench,prefill"]


async def test_stream_is_relayed_as_it_arrives(gateway_factory: GatewayFactory) -> None:
    # ~40 decode steps of >= 25 ms: the whole answer takes over a second upstream.
    slow_decode = EmulatorConfig(step_overhead=0.025)
    async with gateway_factory([slow_decode]) as gw:
        client = async_client(gw)
        t0 = time.monotonic()
        stream = await client.completions.create(model=MODEL, prompt="go", max_tokens=40, stream=True)
        first_at = None
        async for chunk in stream:
            if first_at is None and chunk.choices and chunk.choices[0].text:
                first_at = time.monotonic() - t0
        total = time.monotonic() - t0
        await client.close()
    assert first_at is not None
    assert total > 0.9
    assert first_at < total / 3, (first_at, total)


async def test_client_disconnect_aborts_upstream_and_frees_the_slot(gateway_factory: GatewayFactory) -> None:
    async with gateway_factory([EmulatorConfig(step_overhead=0.02)]) as gw:
        inst = gw.fleet.instances[0]
        async with httpx.AsyncClient(headers={"authorization": f"Bearer {KEY}"}, timeout=30) as h:
            body = {"model": MODEL, "prompt": "long story", "max_tokens": 2000, "stream": True}
            async with h.stream("POST", gw.api_base + "/completions", json=body) as r:
                assert r.status_code == 200
                async for _ in r.aiter_bytes():
                    break  # one chunk, then hang up
        for _ in range(200):
            if inst.stats()["aborted"] == 1 and gw.gateway.fleet.get("i0").inflight == 0:
                break
            await asyncio.sleep(0.02)
        assert inst.stats()["aborted"] == 1
        assert inst.stats()["running"] == 0
        g = gw.gateway.fleet.get("i0")
        assert (g.inflight, g.prefill_tokens, g.prefilling) == (0, 0, 0)


async def test_a_client_gone_before_the_watch_starts_still_aborts_a_non_stream_request(
    gateway_factory: GatewayFactory,
) -> None:
    """The disconnect watcher starts after WATCH_AFTER; a client that left before is seen then."""
    async with gateway_factory([EmulatorConfig(step_overhead=0.02)]) as gw:
        inst = gw.fleet.instances[0]
        async with httpx.AsyncClient(headers={"authorization": f"Bearer {KEY}"}, timeout=30) as h:
            body = {"model": MODEL, "prompt": "long story", "max_tokens": 2000}
            with pytest.raises(httpx.ReadTimeout):
                await h.post(gw.api_base + "/completions", json=body, timeout=httpx.Timeout(30, read=0.01))
        for _ in range(200):
            if inst.stats()["aborted"] == 1 and gw.gateway.fleet.get("i0").inflight == 0:
                break
            await asyncio.sleep(0.02)
        assert inst.stats()["aborted"] == 1 and inst.stats()["running"] == 0
        assert gw.gateway.fleet.get("i0").inflight == 0


async def test_health_ready_and_metrics(gw: Running) -> None:
    async with httpx.AsyncClient(timeout=10) as h:
        assert (await h.get(gw.url + "/health")).status_code == 200
        r = await h.get(gw.url + "/ready")
        assert r.status_code == 200 and r.json()["ready"] is True
        text = (await h.get(gw.url + "/api/metrics")).text
        assert 'taogate_instance_up{instance="i0"} 1.0' in text
        assert "taogate_queue_length 0.0" in text


@pytest.mark.python_only  # sets a method on the token estimator, which a compiled class does not allow
async def test_a_bug_inside_the_gateway_is_an_openai_shaped_500_and_holds_nothing(gw: Running) -> None:
    def broken(*_: object) -> int:
        raise RuntimeError("boom")

    gw.gateway.pipeline.intake.tokens.estimate = broken  # type: ignore[method-assign]
    async with httpx.AsyncClient(headers={"authorization": f"Bearer {KEY}"}, timeout=10) as h:
        r = await h.post(gw.api_base + "/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1})
    assert r.status_code == 500
    err = r.json()["error"]
    assert err["type"] == "internal_error" and r.headers["x-request-id"] in err["message"]
    assert all(i.inflight == 0 for i in gw.gateway.fleet)
