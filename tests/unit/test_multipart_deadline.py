"""A streamed upload is due ``within`` seconds of its start, however it is read: its form head
before dispatch, or the rest while it streams upstream."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from taogate.errors import RequestTimeout
from taogate.proxy.multipart import StreamedBody

FORM = b"multipart/form-data; boundary=b"
HEAD = (
    b'--b\r\ncontent-disposition: form-data; name="model"\r\n\r\nm\r\n'
    b'--b\r\ncontent-disposition: form-data; name="file"; filename="a"\r\n\r\nRIFF'
)


def _client(*chunks: bytes) -> Any:
    """An ASGI receive that hands out ``chunks`` (more to come), then waits for ever."""
    queue = list(chunks)

    async def receive() -> dict[str, Any]:
        if queue:
            return {"type": "http.request", "body": queue.pop(0), "more_body": True}
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    return receive


async def test_a_head_that_stalls_before_its_model_is_late() -> None:
    body = StreamedBody(_client(b"--b\r\ncontent-disp"), 1 << 20, within=0.05)
    with pytest.raises(RequestTimeout):
        await body.read_model(FORM)


async def test_an_upload_that_stalls_while_streaming_is_late() -> None:
    body = StreamedBody(_client(HEAD, b"data"), 1 << 20, within=0.05)
    assert await body.read_model(FORM) == "m"
    seen: list[bytes] = []
    with pytest.raises(RequestTimeout):
        async for chunk in body:
            seen.append(chunk)
    assert seen == [HEAD, b"data"]
