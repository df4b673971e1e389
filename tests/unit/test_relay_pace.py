"""The relay against a client's pace: a slow but steady reader keeps its stream, one that stops
reading at the stream's very end is stalled, and an instance silent after ``[DONE]`` has finished;
and the usage chunk the gateway asked for is kept from the client. The instance's answer is a list
of chunks; the client is a ``send`` that takes its time."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from taogate.proxy.intake import ClientStalled
from taogate.proxy.relay import SEND_BYTES, piece_end, relay_sse, without_usage_only

EVENT = b'data: {"choices":[{"text":"' + b"a" * 200 + b'"}]}\n\n'
DONE = b"data: [DONE]\n\n"


class Answer:
    """An instance's stream: ``chunks`` as they come, then silence for ``then`` seconds."""

    def __init__(self, chunks: list[bytes], then: float = 0.0) -> None:
        self.chunks, self.then = chunks, then

    async def aiter_raw(self) -> AsyncIterator[bytes]:
        for chunk in self.chunks:
            yield chunk
        await asyncio.sleep(self.then)


async def _relay(answer: Answer, send: Any, **kw: Any) -> Any:
    nothing = lambda: None  # noqa: E731
    return await relay_sse(answer, send, instance="i", on_first_chunk=nothing, on_last_message=nothing, **kw)  # type: ignore[arg-type]


async def test_a_slow_but_steady_reader_keeps_a_burst_the_instance_sent_at_once() -> None:
    """600 KB in one chunk to a client taking 200 KB/s, with a 1 s stall limit: sent in one piece,
    it would wait 3 s; in pieces of ``SEND_BYTES``, each waits a third of a second."""
    sent: list[bytes] = []

    async def client(message: dict[str, Any]) -> None:
        body = message.get("body", b"")
        await asyncio.sleep(len(body) / 200_000)
        sent.append(body)

    burst = EVENT * 3_000 + DONE
    end = await _relay(Answer([burst]), client, idle=5.0, stall=1.0)
    assert end.error is None and b"".join(sent) == burst
    assert max(len(body) for body in sent) <= SEND_BYTES
    assert all(body.endswith(b"\n\n") for body in sent if body)  # cut at events' ends


async def test_a_client_that_stops_reading_at_the_stream_s_end_is_stalled() -> None:
    async def client(message: dict[str, Any]) -> None:
        if not message.get("more_body"):
            await asyncio.sleep(30)  # the end never reaches it

    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(ClientStalled):
        await _relay(Answer([EVENT * 3 + DONE]), client, idle=5.0, stall=0.3)
    assert loop.time() - started < 2.0


async def test_an_instance_silent_after_done_has_finished_and_is_not_blamed() -> None:
    sent: list[bytes] = []

    async def client(message: dict[str, Any]) -> None:
        sent.append(message.get("body", b""))

    end = await _relay(Answer([EVENT * 3 + DONE], then=30), client, idle=0.3, stall=1.0)
    assert end.error is None and b"".join(sent) == EVENT * 3 + DONE  # no error event after [DONE]
    silent = await _relay(Answer([EVENT * 3], then=30), client, idle=0.3, stall=1.0)
    assert silent.error == "stream_idle_timeout"  # silent before [DONE]: the instance's failure


@given(st.lists(st.integers(1, 90_000), min_size=1, max_size=12), st.integers(0, 3))
def test_pieces_are_cut_only_at_event_ends(sizes: list[int], crlf: int) -> None:
    events = [b"data: " + b"x" * n + (b"\r\n\r\n" if i % 4 == crlf else b"\n\n") for i, n in enumerate(sizes)]
    data = b"".join(events)
    ends = {len(b"".join(events[: i + 1])) for i in range(len(events))}
    start = 0
    while start < len(data):
        end = piece_end(data, start)
        assert end in ends and end > start
        assert end - start <= SEND_BYTES or not any(start < e < end for e in ends if e - start <= SEND_BYTES)
        start = end


def test_only_the_usage_only_chunk_is_taken_out() -> None:
    usage = b'data: {"id":"c","choices":[],"usage":{"prompt_tokens":1,"completion_tokens":2}}\n\n'
    spaced = b'data: {"id": "c", "choices": [], "usage": {"prompt_tokens": 1}}\n\n'
    running = b'data: {"id":"c","choices":[{"text":"a"}],"usage":{"prompt_tokens":1}}\n\n'
    assert without_usage_only(EVENT + usage + DONE) == EVENT + DONE
    assert without_usage_only(spaced + DONE) == DONE
    assert without_usage_only(usage) == b""
    assert without_usage_only(running + DONE) == running + DONE  # a choice: the client's to see
    assert without_usage_only(b'data: {"usage": [not json\n\n') == b'data: {"usage": [not json\n\n'
