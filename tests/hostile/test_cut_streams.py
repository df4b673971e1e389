"""Hostile instances that cut a stream in the middle of an event: the client's SDK must read an
error event and raise its API error, never parse half a JSON (the OpenAI and Anthropic SDKs)."""

from __future__ import annotations

import json
import logging
import socket
import time
from typing import Any

import anthropic
import openai
import pytest

from tests.hostile.attacks import CHAT_EVENT, SSE_HEAD, cut
from tests.hostile.helpers import HOSTILE, KEY, beside, gateway, hostile_request, in_thread, slots_free

pytestmark = pytest.mark.timeout(90)

MESSAGE_START = (
    b'event: message_start\ndata: {"type":"message_start","message":{"id":"m","type":"message",'
    b'"role":"assistant","model":"hostile-model","content":[],"stop_reason":null,"stop_sequence":null,'
    b'"usage":{"input_tokens":1,"output_tokens":0}}}\n\n'
    b'event: content_block_start\ndata: {"type":"content_block_start","index":0,'
    b'"content_block":{"type":"text","text":""}}\n\n'
)


def _openai_chat(url: str) -> list[Any]:
    client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
    stream = client.chat.completions.create(
        model=HOSTILE, messages=[{"role": "user", "content": "hi"}], stream=True
    )
    return list(stream)


def _anthropic_messages(url: str) -> list[Any]:
    client = anthropic.Anthropic(base_url=url, api_key=KEY, max_retries=0)
    stream = client.messages.create(
        model=HOSTILE, max_tokens=8, messages=[{"role": "user", "content": "hi"}], stream=True
    )
    return list(stream)


CUTS = pytest.mark.parametrize("chunked", [True, False], ids=["broken", "ended"])


@CUTS
async def test_the_openai_sdk_raises_its_api_error_on_a_stream_cut_inside_an_event(chunked: bool) -> None:
    async with gateway(cut(CHAT_EVENT, b'data: {"id":"c","choi', chunked)) as (gw, _), beside(gw):
        with pytest.raises(openai.APIError) as caught:
            await in_thread(_openai_chat, gw.url)
    assert "broke the stream" in str(caught.value) or "inside an event" in str(caught.value)


@CUTS
async def test_the_anthropic_sdk_raises_its_api_error_on_a_stream_cut_inside_an_event(chunked: bool) -> None:
    fragment = b'event: content_block_delta\ndata: {"type":"content_block_delta","ind'
    async with gateway(cut(MESSAGE_START, fragment, chunked)) as (gw, _), beside(gw):
        with pytest.raises(anthropic.APIStatusError) as caught:
            await in_thread(_anthropic_messages, gw.url)
    assert caught.value.status_code == 502 or "stream" in str(caught.value)


def _done_then_silent(sock: socket.socket, head: bytes, body: bytes) -> None:
    sock.sendall(SSE_HEAD + CHAT_EVENT * 3 + b"data: [DONE]\n\n")
    time.sleep(3)  # and keeps the connection open


def _read_stream(url: str) -> bytes:
    body = json.dumps(hostile_request(stream=True)).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {KEY}\r\n"
        f"content-type: application/json\r\ncontent-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(head.encode() + body)
        got = b""
        while piece := sock.recv(65536):
            got += piece
        return got


async def test_an_instance_silent_after_done_has_finished_its_stream(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """``[DONE]`` relayed, the instance keeps the connection open: the stream ends at the idle
    timeout without an error event, and the instance is not blamed."""
    caplog.set_level(logging.INFO, logger="taogate.access")
    lines: list[str] = []
    sections: dict[str, Any] = {"gateway": {"stream_idle_timeout": 0.5}}
    async with gateway(_done_then_silent, access_sink=lines.append, **sections) as (gw, _):
        got = await in_thread(_read_stream, gw.url)
        await slots_free(gw)
        assert gw.gateway.fleet.get("hostile").window.stats(gw.gateway.clock()).errors == 0
    assert got.count(b"data: [DONE]") == 1 and b"error" not in got
    served = [line for line in lines if HOSTILE in line]
    assert len(served) == 1 and "status=200" in served[0] and "error=" not in served[0], served
