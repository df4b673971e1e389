"""Hostile instances that cut a stream in the middle of an event: the client's SDK must read an
error event and raise its API error, never parse half a JSON (the OpenAI and Anthropic SDKs)."""

from __future__ import annotations

from typing import Any

import anthropic
import openai
import pytest

from tests.hostile.attacks import CHAT_EVENT, cut
from tests.hostile.helpers import HOSTILE, KEY, beside, gateway, in_thread

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
