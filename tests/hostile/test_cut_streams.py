"""Hostile instances that cut a stream in the middle of an event: the client's SDK must read an
error event and raise its API error, never parse half a JSON (the OpenAI and Anthropic SDKs)."""

from __future__ import annotations

import socket
from typing import Any

import anthropic
import openai
import pytest

from tests.hostile.helpers import HOSTILE, KEY, beside, gateway, in_thread

pytestmark = pytest.mark.timeout(90)

SSE_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n"
CHAT_EVENT = b'data: {"id":"c","object":"chat.completion.chunk","model":"hostile-model","created":1,"choices":[{"index":0,"delta":{"content":"a"}}]}\n\n'  # noqa: E501
MESSAGE_START = (
    b'event: message_start\ndata: {"type":"message_start","message":{"id":"m","type":"message",'
    b'"role":"assistant","model":"hostile-model","content":[],"stop_reason":null,"stop_sequence":null,'
    b'"usage":{"input_tokens":1,"output_tokens":0}}}\n\n'
    b'event: content_block_start\ndata: {"type":"content_block_start","index":0,'
    b'"content_block":{"type":"text","text":""}}\n\n'
)


def _cut(events: bytes, cut: bytes, chunked: bool) -> Any:
    """An instance that sends whole ``events``, then ``cut`` (half an event), then closes: inside a
    chunk of a chunked body (a broken answer), or at the end of an until-close body (a clean end)."""

    def answer(sock: socket.socket, head: bytes, body: bytes) -> None:
        if chunked:
            sock.sendall(SSE_HEAD.replace(b"\r\n\r\n", b"\r\ntransfer-encoding: chunked\r\n\r\n"))
            sock.sendall(b"%x\r\n%s\r\n" % (len(events), events))
            sock.sendall(b"%x\r\n%s" % (len(cut) + 10, cut))
        else:
            sock.sendall(SSE_HEAD + events + cut)
        sock.shutdown(socket.SHUT_WR)

    return answer


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
    async with gateway(_cut(CHAT_EVENT, b'data: {"id":"c","choi', chunked)) as (gw, _), beside(gw):
        with pytest.raises(openai.APIError) as caught:
            await in_thread(_openai_chat, gw.url)
    assert "broke the stream" in str(caught.value) or "inside an event" in str(caught.value)


@CUTS
async def test_the_anthropic_sdk_raises_its_api_error_on_a_stream_cut_inside_an_event(chunked: bool) -> None:
    cut = b'event: content_block_delta\ndata: {"type":"content_block_delta","ind'
    async with gateway(_cut(MESSAGE_START, cut, chunked)) as (gw, _), beside(gw):
        with pytest.raises(anthropic.APIStatusError) as caught:
            await in_thread(_anthropic_messages, gw.url)
    assert caught.value.status_code == 502 or "stream" in str(caught.value)
