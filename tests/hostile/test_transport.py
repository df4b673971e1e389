"""Hostile input on the proxied hop itself: a request line that tries to carry headers, and answers
that fail after a large body (whose buffers must be freed without a full garbage collection)."""

from __future__ import annotations

import contextlib
import gc
import socket
import threading
import time
import tracemalloc
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from taogate import h1
from taogate.app import RunningGateway, serve_gateway
from tests.conftest import KEY, gateway_settings, wait_until
from tests.hostile.helpers import (
    AUTH,
    HOSTILE,
    ScriptedInstance,
    answer_json,
    connect,
    gateway,
    hostile_request,
    in_thread,
    read_all,
    rss,
    slots_free,
    status_of,
)

pytestmark = pytest.mark.timeout(120)

#: Percent-encoded CR LF, NUL and space in a stored response's path, as a client may send them.
INJECTIONS = [
    "/v1/responses/x%0d%0aX-Injected:%20yes%0d%0aX-P:%20/cancel",
    "/v1/responses/x%0aX-Injected:%20yes",
    "/v1/responses/x%00y",
    "/v1/responses/x%20HTTP%2F1.1%0d%0aX-Injected:%20yes",
]


@contextlib.asynccontextmanager
async def only(answer: Any) -> AsyncIterator[tuple[RunningGateway, ScriptedInstance]]:
    """A gateway in front of one scripted instance alone (every request reaches it)."""
    with ScriptedInstance(answer) as scripted:
        settings = gateway_settings([scripted.url], names=["hostile"], dispatch={"scrape_interval": 0})
        async with serve_gateway(settings, key=KEY) as gw:
            inst = gw.gateway.fleet.get("hostile")
            await wait_until(lambda: HOSTILE in inst.model_cards, within=10, what="probes")
            yield gw, scripted


def _raw_post(gw: RunningGateway, path: str) -> bytes:
    head = f"POST {path} HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {KEY}\r\nconnection: close\r\n"
    with connect(gw) as sock:
        sock.sendall(head.encode() + b"content-length: 0\r\n\r\n")
        return read_all(sock)


@pytest.mark.parametrize("path", INJECTIONS, ids=["crlf", "lf", "nul", "space"])
async def test_a_percent_encoded_control_byte_never_reaches_the_upstream_request_line(path: str) -> None:
    def answer(sock: socket.socket, head: bytes, body: bytes) -> None:
        sock.sendall(answer_json())

    async with only(answer) as (gw, scripted):
        response = await in_thread(_raw_post, gw, path)
        await slots_free(gw)
    assert status_of(response) == 200, response[:300]
    assert len(scripted.heads) == 1
    line, _, rest = scripted.heads[0].partition(b"\r\n")
    assert line == f"POST {path} HTTP/1.1".encode(), line  # still percent-encoded, as the client sent it
    assert b"x-injected" not in rest.lower() and b"\x00" not in scripted.heads[0]


@pytest.mark.parametrize(
    ("target", "headers"),
    [
        (b"/v1/x\r\nX-Injected: yes", []),
        (b"/v1/x\nX-Injected: yes", []),
        (b"/v1/x\x00y", []),
        (b"/v1/x y", []),
        (b"/v1/x\ty", []),
        (b"/v1/x\x7fy", []),
        (b"/v1/x", [(b"x-value", b"a\r\nX-Injected: yes")]),
        (b"/v1/x", [(b"x-value", b"a\nX-Injected: yes")]),
        (b"/v1/x", [(b"x-value", b"a\x00")]),
        (b"/v1/x", [(b"x-name\r\nX-Injected", b"yes")]),
    ],
    ids=[
        "target-crlf",
        "target-lf",
        "target-nul",
        "target-space",
        "target-tab",
        "target-del",
        "value-crlf",
        "value-lf",
        "value-nul",
        "name",
    ],
)
async def test_h1_refuses_to_send_a_target_or_header_that_would_split_the_request(
    target: bytes, headers: list[tuple[bytes, bytes]]
) -> None:
    def answer(sock: socket.socket, head: bytes, body: bytes) -> None:
        sock.sendall(answer_json())

    with ScriptedInstance(answer) as scripted:
        pool = h1.Pool(4, connect_timeout=5, read_timeout=5, pool_timeout=5)
        origin = h1.Origin.parse(scripted.url)
        try:
            with pytest.raises(h1.InvalidRequest):
                await pool.request(origin, target, headers, b"{}")
            r = await pool.request(origin, b"/v1/x", [(b"x-value", b"a b\tc")], b"{}")  # still usable
            assert r.status_code == 200
            await r.aread()
        finally:
            await pool.aclose()
    assert len(scripted.heads) == 1 and scripted.heads[0].startswith(b"POST /v1/x HTTP/1.1\r\n")


# -- a failed answer's buffers -------------------------------------------------------------------
BODY_MIB = 60
CONCURRENT = 8
ROUNDS = 3


def big_then_silent(mib: int, silence: float | None = None) -> Any:
    """An answer: chunked JSON, ``mib`` MiB of it, then nothing; for ``silence`` seconds and then
    the connection closes, or (None) until the gateway hangs up."""

    def answer(sock: socket.socket, head: bytes, body: bytes) -> None:
        sock.sendall(
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n"
        )
        piece = b" " * (1 << 20)
        chunk = b"%x\r\n%s\r\n" % (len(piece), piece)
        sock.sendall(b"1\r\n[\r\n")
        for _ in range(mib):
            sock.sendall(chunk)
        if silence is not None:
            time.sleep(silence)
            return
        sock.settimeout(60)
        with contextlib.suppress(OSError):
            while sock.recv(65536):
                pass

    return answer


def _round(url: str) -> list[httpx.Response]:
    """Eight requests at once, each on a thread of its own."""
    results: list[httpx.Response] = []
    lock = threading.Lock()

    def one() -> None:
        with httpx.Client(headers=AUTH, timeout=60) as client:
            r = client.post(url + "/v1/completions", json=hostile_request())
        with lock:
            results.append(r)

    threads = [threading.Thread(target=one) for _ in range(CONCURRENT)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    return results


async def test_answers_that_fail_after_a_large_body_are_freed_without_a_garbage_collection() -> None:
    """Eight 60 MiB answers that then fall silent, three rounds, with the cyclic collector off (the
    gateway runs it rarely): refcounting alone frees them. Live Python memory (tracemalloc) is back
    near where it started after each round; RSS stays under what one round holds at its peak (the
    allocator keeps some freed memory for reuse: ``malloc_trim`` would hand it back)."""
    sections: dict[str, Any] = {"gateway": {"request_timeout": 2, "max_response_bytes": 128 << 20}}
    async with gateway(big_then_silent(BODY_MIB), **sections) as (gw, _):
        gc.collect()
        before = rss()
        gc.disable()
        tracemalloc.start()
        try:
            start = tracemalloc.get_traced_memory()[0]
            live: list[int] = []
            resident: list[int] = []
            for _ in range(ROUNDS):
                results = await in_thread(_round, gw.url)
                assert [r.status_code for r in results] == [504] * CONCURRENT, [r.text[:200] for r in results]
                await slots_free(gw)
                live.append(tracemalloc.get_traced_memory()[0] - start)
                resident.append(rss())
        finally:
            tracemalloc.stop()
            gc.enable()
    assert max(live) < 16 << 20, f"live after each round: {[n >> 20 for n in live]} MiB"
    peak = CONCURRENT * BODY_MIB << 20
    assert max(resident) - before < peak, f"RSS: {[(n - before) >> 20 for n in resident]} MiB over the start"
