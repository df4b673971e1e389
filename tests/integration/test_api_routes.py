"""vLLM's other routes through the gateway: dispatched by the model the body names, answered by
the instance (its 404 too), multipart uploads streamed, and /version, /ping, /load for the fleet."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx
import openai
import pytest

from taogate.emulator.config import EmulatorConfig
from taogate.serving import serve_asgi
from tests.conftest import KEY, GatewayFactory, gateway_settings, serve, wait_until
from tests.integration.recording import Upstream

AUTH = {"authorization": f"Bearer {KEY}"}
POOLING = ["/pooling", "/classify", "/score", "/v1/score", "/rerank", "/v1/rerank", "/v2/rerank"]


@pytest.fixture
async def pair() -> AsyncIterator[tuple[Upstream, Upstream, str]]:
    """A reranker and a speech model, and a gateway in front of both."""
    rerank, speech = Upstream("reranker"), Upstream("whisper")
    async with serve_asgi(rerank) as a, serve_asgi(speech) as b:
        settings = gateway_settings([a.url, b.url], dispatch={"scrape_interval": 0})
        async with serve(settings) as gw:
            await wait_until(lambda: all(i.models for i in gw.gateway.fleet), what="models learned")
            yield rerank, speech, gw.url


async def test_pooling_routes_go_to_the_model_they_name_with_the_body_as_sent(
    pair: tuple[Upstream, Upstream, str],
) -> None:
    rerank, speech, url = pair
    async with httpx.AsyncClient(timeout=30) as http:
        for path in [*POOLING, "/invocations", "/v1/chat/completions/batch"]:
            body = b'{"model": "reranker", "query": "q", "documents": ["a", "b"], "priority": 3}'
            reply = await http.post(
                url + path, content=body, headers={**AUTH, "content-type": "application/json"}
            )
            assert reply.status_code == 200 and reply.json() == {"model": "reranker", "path": path}
            assert rerank.seen[-1].body == body  # verbatim: an fcfs instance is told nothing
        assert not speech.seen
        denied = await http.post(url + "/score", json={"model": "reranker"})
        assert denied.status_code == 401
        unknown = await http.post(url + "/rerank", json={"model": "nope"}, headers=AUTH)
        assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"


async def test_a_route_the_instance_does_not_serve_answers_its_404(gateway_factory: GatewayFactory) -> None:
    async with gateway_factory([EmulatorConfig()]) as gw, httpx.AsyncClient(timeout=30) as http:
        reply = await http.post(gw.url + "/score", json={"text_1": "a", "text_2": "b"}, headers=AUTH)
        assert reply.status_code == 404 and reply.json() == {"detail": "Not Found"}
        assert reply.headers["x-taogate-instance"] == "i0"


async def test_the_sdk_s_transcription_goes_to_the_model_in_the_form(
    pair: tuple[Upstream, Upstream, str],
) -> None:
    rerank, speech, url = pair
    audio = b"RIFF" + bytes(range(256)) * 64
    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0) as client:
        result = await client.audio.transcriptions.create(
            model="whisper", file=("a.wav", audio, "audio/x-wav")
        )
        assert result.text == "transcribed"
    async with httpx.AsyncClient(timeout=30) as http:
        form = {"model": "whisper", "response_format": "json"}
        reply = await http.post(
            url + "/v1/audio/translations", data=form, files={"file": audio}, headers=AUTH
        )
        assert reply.status_code == 200 and reply.json() == {"text": "transcribed"}
    assert not rerank.seen and [s.path for s in speech.seen] == [
        "/v1/audio/transcriptions",
        "/v1/audio/translations",
    ]
    sent = speech.seen[0]
    assert sent.headers["content-type"].startswith("multipart/form-data; boundary=")
    assert audio in sent.body and b'name="model"' in sent.body
    assert sent.headers["content-length"] == str(len(sent.body))


async def test_an_upload_is_streamed_upstream_before_its_end_arrives(
    pair: tuple[Upstream, Upstream, str],
) -> None:
    """The file part starts upstream while the client is still sending it: the client waits for
    the instance to see the first bytes before it sends the rest (a buffering gateway would hang)."""
    _, speech, url = pair
    boundary = b"b0undary"
    head = b"--" + boundary + b'\r\ncontent-disposition: form-data; name="model"\r\n\r\nwhisper\r\n'
    head += b"--" + boundary + b'\r\ncontent-disposition: form-data; name="file"; filename="a.wav"\r\n\r\n'
    tail = b"x" * 100_000 + b"\r\n--" + boundary + b"--\r\n"

    async def body() -> AsyncIterator[bytes]:
        yield head
        await asyncio.wait_for(speech.first_chunk.wait(), 10)
        yield tail

    headers = {**AUTH, "content-type": "multipart/form-data; boundary=b0undary"}
    async with httpx.AsyncClient(timeout=30) as http:
        reply = await http.post(url + "/v1/audio/transcriptions", content=body(), headers=headers)
    assert reply.status_code == 200 and reply.json() == {"text": "transcribed"}
    assert speech.seen[-1].body == head + tail and speech.seen[-1].chunks >= 2


async def test_an_upload_over_the_body_limit_is_refused(gateway_factory: GatewayFactory) -> None:
    async with gateway_factory([EmulatorConfig()], gateway={"max_body_bytes": 4096}) as gw:
        files = {"file": ("a.wav", b"x" * 10_000)}
        async with httpx.AsyncClient(timeout=30) as http:
            reply = await http.post(gw.url + "/v1/audio/transcriptions", files=files, headers=AUTH)
        assert reply.status_code == 413


async def test_version_ping_and_load_answer_for_the_fleet(gateway_factory: GatewayFactory) -> None:
    async with (
        gateway_factory([EmulatorConfig(), EmulatorConfig()]) as gw,
        httpx.AsyncClient(timeout=30) as http,
    ):
        version = (await http.get(gw.url + "/version")).json()
        assert version["version"].startswith("0.") and set(version["instances"]) == {"i0", "i1"}
        assert version["taogate"]
        assert (await http.get(gw.url + "/api/ping")).status_code == 200
        assert (await http.post(gw.url + "/ping")).status_code == 200
        load = (await http.get(gw.url + "/load")).json()
        assert load == {"server_load": 0, "instances": {"i0": 0, "i1": 0}}
        for inst in gw.fleet.instances:
            inst.faults.merge({"unhealthy": True})
        await wait_until(lambda: not any(i.up for i in gw.gateway.fleet), what="instances down")
        assert (await http.get(gw.url + "/ping")).status_code == 503
