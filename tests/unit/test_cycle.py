"""``taogate.cycle``: what it writes for a response is what uvicorn's own cycle writes (framing,
``connection: close``, HEAD, 204/304, length errors), the head leaves with the body in one write,
and ``receive`` answers as uvicorn's does (body pieces, the body's end, then ``http.disconnect``)."""

from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace
from typing import Any, cast

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

from taogate.cycle import Connection, Cycle


class _Wire:
    """A transport that records what is written to it."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closed = False
        self.paused = False

    def write(self, data: bytes) -> None:
        assert not self.closed, "written after it closed"
        if data:
            self.writes.append(data)

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def get_write_buffer_size(self) -> int:
        return 0  # every write taken at once

    def pause_reading(self) -> None:
        self.paused = True

    def resume_reading(self) -> None:
        self.paused = False


class _Protocol:
    """What a cycle asks of its protocol."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.transport = _Wire()
        self.flow = FlowControl(cast(asyncio.Transport, self.transport))
        self.server_state = SimpleNamespace(default_headers=[(b"date", b"Thu, 03 Dec 2026 06:00:00 GMT")])
        self.loop = loop
        self.completed = 0
        self.write_stall: float | None = None

    def close_after_response(self) -> None:
        self.transport.close()

    def on_response_complete(self) -> None:
        self.completed += 1


def _scope(method: str = "POST") -> dict[str, Any]:
    return {"type": "http", "method": method, "headers": []}


def _cycle(
    loop: asyncio.AbstractEventLoop, method: str = "POST", *, keep_alive: bool = True, expect: bool = False
) -> tuple[Cycle, _Protocol]:
    protocol = _Protocol(loop)
    cycle = Cycle(cast(Connection, protocol), _scope(method), keep_alive, expect)
    return cycle, protocol


def _uvicorn_cycle(method: str, keep_alive: bool, wire: _Wire, default: list[tuple[bytes, bytes]]) -> Any:
    log = logging.getLogger("test.cycle")
    return RequestResponseCycle(
        scope=cast(Any, _scope(method)),
        transport=cast(asyncio.Transport, wire),
        flow=FlowControl(cast(asyncio.Transport, wire)),
        logger=log,
        access_logger=log,
        access_log=False,
        default_headers=default,
        message_event=asyncio.Event(),
        expect_100_continue=False,
        keep_alive=keep_alive,
        on_response=lambda: None,
    )


_VALUE = st.text(alphabet=st.sampled_from("abcXYZ019 ;=,/-\t"), max_size=8).map(str.encode)
_FIELD = st.one_of(
    st.tuples(st.sampled_from([b"content-type", b"x-request-id", b"x-a", b"cache-control"]), _VALUE),
    st.tuples(st.just(b"content-length"), st.integers(0, 12).map(lambda n: str(n).encode())),
    st.tuples(st.just(b"transfer-encoding"), st.sampled_from([b"chunked", b"Chunked", b"gzip"])),
    st.tuples(st.just(b"connection"), st.sampled_from([b"close", b"keep-alive", b"Upgrade, Close", b"x"])),
)
_BODIES = st.lists(st.binary(max_size=6), min_size=1, max_size=4)


async def _play(cycle: Any, status: int, fields: list[tuple[bytes, bytes]], bodies: list[bytes]) -> str:
    """Sends a response to ``cycle``; what it raised, if anything."""
    try:
        await cycle.send({"type": "http.response.start", "status": status, "headers": fields})
        for i, body in enumerate(bodies):
            await cycle.send({"type": "http.response.body", "body": body, "more_body": i < len(bodies) - 1})
    except RuntimeError as exc:
        return str(exc)
    except ValueError:
        return "bad content-length"
    return ""


@settings(max_examples=300, deadline=None)
@given(
    method=st.sampled_from(["GET", "POST", "HEAD"]),
    status=st.sampled_from([200, 201, 204, 304, 404, 500]),
    keep_alive=st.booleans(),
    fields=st.lists(_FIELD, max_size=5),
    bodies=_BODIES,
)
def test_a_response_is_written_as_uvicorns_cycle_writes_it(
    method: str, status: int, keep_alive: bool, fields: list[tuple[bytes, bytes]], bodies: list[bytes]
) -> None:
    async def both() -> None:
        loop = asyncio.get_running_loop()
        ours, protocol = _cycle(loop, method, keep_alive=keep_alive)
        theirs_wire = _Wire()
        theirs = _uvicorn_cycle(method, keep_alive, theirs_wire, protocol.server_state.default_headers)
        our_error = await _play(ours, status, fields, bodies)
        their_error = await _play(theirs, status, fields, bodies)
        await asyncio.sleep(0)  # a head held for its body goes out at the end of the turn
        assert our_error == their_error
        assert b"".join(protocol.transport.writes) == b"".join(theirs_wire.writes)
        assert protocol.transport.closed == theirs_wire.closed
        assert ours.keep_alive == theirs.keep_alive and ours.response_complete == theirs.response_complete
        assert protocol.completed == (1 if ours.response_complete else 0)

    asyncio.run(both())


@pytest.mark.parametrize("value", [b"a\r\nset-cookie: x=1", b"a\nb", b"a\rb"])
async def test_a_field_that_would_split_the_head_is_refused(value: bytes) -> None:
    cycle, protocol = _cycle(asyncio.get_running_loop())
    with pytest.raises(RuntimeError, match="Invalid HTTP header"):
        await cycle.send({"type": "http.response.start", "status": 200, "headers": [(b"x-a", value)]})
    await asyncio.sleep(0)
    assert protocol.transport.writes == []


async def test_a_response_head_goes_out_with_its_body_in_one_write() -> None:
    cycle, protocol = _cycle(asyncio.get_running_loop())
    await cycle.send({"type": "http.response.start", "status": 200, "headers": []})
    assert protocol.transport.writes == []
    await cycle.send({"type": "http.response.body", "body": b"body", "more_body": True})
    await cycle.send({"type": "http.response.body", "body": b"more", "more_body": False})
    head, *rest = protocol.transport.writes
    assert head.startswith(b"HTTP/1.1 200 OK\r\n") and head.endswith(b"\r\n\r\n4\r\nbody\r\n")
    assert rest == [b"4\r\nmore\r\n0\r\n\r\n"]
    await asyncio.sleep(0)
    assert len(protocol.transport.writes) == 2


async def test_a_head_without_a_body_yet_goes_out_at_the_end_of_the_turn_unless_the_client_left() -> None:
    loop = asyncio.get_running_loop()
    stream, protocol = _cycle(loop)
    await stream.send({"type": "http.response.start", "status": 200, "headers": []})
    await asyncio.sleep(0)
    assert len(protocol.transport.writes) == 1
    gone, protocol = _cycle(loop)
    await gone.send({"type": "http.response.start", "status": 200, "headers": []})
    protocol.transport.closed = True  # the client went away within the loop turn
    await asyncio.sleep(0)
    assert protocol.transport.writes == []
    big, protocol = _cycle(loop)
    await big.send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"70000")]})
    await big.send({"type": "http.response.body", "body": b"x" * 70000})
    assert [len(w) for w in protocol.transport.writes][1:] == [70000]  # not copied to be joined


async def test_a_failing_app_gets_uvicorns_500_and_a_closed_connection() -> None:
    cycle, protocol = _cycle(asyncio.get_running_loop())

    async def app(scope: Any, receive: Any, send: Any) -> None:
        raise LookupError("boom")

    await cycle.run(app, set())
    wire = b"".join(protocol.transport.writes)
    assert wire.startswith(b"HTTP/1.1 500 Internal Server Error\r\n")
    assert wire.endswith(b"\r\n\r\nInternal Server Error")
    assert protocol.transport.closed and protocol.completed == 1


async def test_an_app_that_leaves_its_response_unfinished_is_logged_as_uvicorn_logs_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    cycle, protocol = _cycle(asyncio.get_running_loop())

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})

    with caplog.at_level(logging.ERROR, logger="uvicorn.error"):
        await cycle.run(app, set())
    assert [r.getMessage() for r in caplog.records] == ["ASGI callable returned without completing response."]
    assert protocol.transport.closed


async def test_receive_gives_the_body_its_end_then_a_disconnect_once_the_response_is_done() -> None:
    cycle, protocol = _cycle(asyncio.get_running_loop(), expect=True)
    cycle.on_body(b"ab")
    cycle.on_body(b"cd")
    assert await cycle.receive() == {"type": "http.request", "body": b"abcd", "more_body": True}
    assert protocol.transport.writes == [b"HTTP/1.1 100 Continue\r\n\r\n"]
    waiting = asyncio.ensure_future(cycle.receive())
    await asyncio.sleep(0)
    assert not waiting.done()
    cycle.on_end()
    assert await waiting == {"type": "http.request", "body": b"", "more_body": False}
    watch = asyncio.ensure_future(cycle.receive())  # a disconnect watch: waits for the end
    cancelled = asyncio.ensure_future(cycle.receive())
    await asyncio.sleep(0)
    cancelled.cancel()
    await cycle.send({"type": "http.response.start", "status": 204, "headers": []})
    await cycle.send({"type": "http.response.body", "body": b""})
    assert await watch == {"type": "http.disconnect"}
    assert cancelled.cancelled()


async def test_a_client_gone_ends_receive_and_send_writes_nothing() -> None:
    cycle, protocol = _cycle(asyncio.get_running_loop())
    waiting = asyncio.ensure_future(cycle.receive())
    await asyncio.sleep(0)
    cycle.on_lost()
    assert await waiting == {"type": "http.disconnect"}
    await cycle.send({"type": "http.response.start", "status": 200, "headers": []})
    await asyncio.sleep(0)
    assert protocol.transport.writes == []


async def test_a_large_body_pauses_reading_until_the_app_receives() -> None:
    cycle, protocol = _cycle(asyncio.get_running_loop())
    cycle.on_body(b"x" * 40000)
    assert not protocol.transport.paused
    cycle.on_body(b"x" * 40000)
    assert protocol.transport.paused
    message = await cycle.receive()
    assert len(message["body"]) == 80000 and not protocol.transport.paused


async def test_send_waits_while_the_transport_asks_to_pause_writing() -> None:
    cycle, protocol = _cycle(asyncio.get_running_loop())
    await cycle.send({"type": "http.response.start", "status": 200, "headers": []})
    protocol.flow.pause_writing()
    piece = {"type": "http.response.body", "body": b"x", "more_body": True}
    sending = asyncio.ensure_future(cycle.send(piece))
    await asyncio.sleep(0.01)
    assert not sending.done() and b"".join(protocol.transport.writes).endswith(b"\r\n\r\n")
    protocol.flow.resume_writing()
    await sending
    assert protocol.transport.writes[-1] == b"1\r\nx\r\n"
