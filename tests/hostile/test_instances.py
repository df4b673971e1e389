"""Hostile instances: answers that are huge, endless, dripping, malformed or that try to speak for the
gateway. Each attack runs beside a normal client on a healthy instance (``helpers.beside``)."""

from __future__ import annotations

import logging
import socket
import time
from typing import Any

import httpx
import pytest

from tests.hostile.helpers import (
    AUTH,
    answer_json,
    beside,
    completion,
    gateway,
    hostile_request,
    in_thread,
)

pytestmark = pytest.mark.timeout(90)


def _call(url: str, body: dict[str, Any], timeout: float = 20.0) -> httpx.Response:
    with httpx.Client(headers=AUTH, timeout=timeout) as client:
        return client.post(url + "/v1/completions", json=body)


def _stream(url: str, body: dict[str, Any], timeout: float = 20.0) -> tuple[float, httpx.Response, bytes]:
    t = time.perf_counter()
    with (
        httpx.Client(headers=AUTH, timeout=timeout) as client,
        client.stream("POST", url + "/v1/completions", json=body) as r,
    ):
        data = b"".join(r.iter_bytes())
    return time.perf_counter() - t, r, data


async def test_a_usage_object_of_many_nested_pairs_costs_its_neighbours_nothing() -> None:
    usage = '{"prompt_tokens":1,"completion_tokens":1,"x":[' + ",".join(["{}"] * 100_000) + "]}"

    def answer(sock: socket.socket, head: bytes, body: bytes) -> None:
        sock.sendall(answer_json(payload=completion(usage=usage)))

    async with gateway(answer) as (gw, _), beside(gw):
        r = await in_thread(_call, gw.url, hostile_request())
    assert r.status_code == 200 and len(r.content) > 300_000


def _endless(sock: socket.socket, head: bytes, body: bytes) -> None:
    sock.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n")
    piece = b"%x\r\n%s\r\n" % (65536, b" " * 65536)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        sock.sendall(piece)


async def test_an_endless_whole_answer_is_cut_off_at_the_cap_without_blaming_the_instance() -> None:
    sections: dict[str, Any] = {
        "gateway": {"max_response_bytes": 8 << 20},
        "dispatch": {"breaker_failures": 1},
    }
    async with gateway(_endless, **sections) as (gw, _):
        async with beside(gw):
            r = await in_thread(_call, gw.url, hostile_request())
        assert r.status_code == 502 and r.json()["error"]["code"] == "upstream_response_too_large"
        inst = gw.gateway.fleet.get("hostile")
        assert inst.breaker.state(gw.gateway.clock()).value == "closed"


async def test_a_101_switching_protocols_is_a_502_and_never_a_traceback(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def answer(sock: socket.socket, head: bytes, body: bytes) -> None:
        sock.sendall(
            b"HTTP/1.1 101 Switching Protocols\r\nupgrade: websocket\r\nconnection: upgrade\r\n\r\nRAW"
        )
        time.sleep(0.5)

    caplog.set_level(logging.WARNING)
    async with gateway(answer) as (gw, _), beside(gw):
        for _ in range(3):
            r = await in_thread(_call, gw.url, hostile_request())
            assert r.status_code == 502, r.text
    assert "101" in r.json()["error"]["message"]
    assert not [rec for rec in caplog.records if rec.levelno >= logging.ERROR], caplog.text


@pytest.mark.parametrize("status", [b"099", b"700", b"999"])
async def test_a_status_outside_http_s_range_is_a_502_and_never_a_traceback(
    status: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    def answer(sock: socket.socket, head: bytes, body: bytes) -> None:
        sock.sendall(b"HTTP/1.1 " + status + b" X\r\ncontent-length: 2\r\n\r\n{}")

    caplog.set_level(logging.WARNING)
    async with gateway(answer) as (gw, _), beside(gw):
        r = await in_thread(_call, gw.url, hostile_request())
    assert r.status_code == 502, r.text
    assert status.decode().lstrip("0") in r.json()["error"]["message"]
    assert not [rec for rec in caplog.records if rec.levelno >= logging.ERROR], caplog.text


def _drip(sock: socket.socket, head: bytes, body: bytes) -> None:
    sock.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n")
    sock.sendall(b'data: {"id":"x","choices":[{"text":"a"}]}\n\n')
    for byte in b'data: {"id":"x","choices":[{"text":"' + b"b" * 200:
        sock.sendall(bytes([byte]))
        time.sleep(0.1)


def _pings(sock: socket.socket, head: bytes, body: bytes) -> None:
    sock.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n")
    for _ in range(300):
        sock.sendall(b": keep-alive\n\n")
        time.sleep(0.05)


@pytest.mark.parametrize(
    ("answer", "code", "sections"),
    [
        (_drip, "stream_idle_timeout", {"stream_idle_timeout": 1.0}),
        (_pings, "stream_timeout", {"stream_timeout": 1.0}),
    ],
    ids=["a-byte-at-a-time", "events-for-ever"],
)
async def test_a_stream_that_never_finishes_is_ended_and_frees_its_slot(
    answer: Any, code: str, sections: dict[str, Any]
) -> None:
    async with gateway(answer, gateway=sections) as (gw, _), beside(gw):
        took, r, data = await in_thread(_stream, gw.url, hostile_request(stream=True))
    assert r.status_code == 200 and took < 4.0
    assert f'"code":"{code}"'.encode() in data and data.endswith(b"data: [DONE]\n\n")


def _huge_response_header(sock: socket.socket, head: bytes, body: bytes) -> None:
    sock.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nx-big: ")
    piece = b"a" * 65536
    for _ in range(160):  # 10 MiB
        sock.sendall(piece)
    sock.sendall(b"\r\n" + answer_json()[len(b"HTTP/1.1 200 OK\r\n") :])


def _many_response_headers(sock: socket.socket, head: bytes, body: bytes) -> None:
    fields = b"".join(b"x-h%d: v\r\n" % i for i in range(100_000))
    sock.sendall(answer_json(fields))


def _endless_interim(sock: socket.socket, head: bytes, body: bytes) -> None:
    for _ in range(10_000):
        sock.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")


@pytest.mark.parametrize(
    "answer",
    [_huge_response_header, _many_response_headers, _endless_interim],
    ids=["10MiB-header", "100k-headers", "endless-100-continue"],
)
async def test_an_oversized_response_head_is_a_502_beside_unharmed_neighbours(answer: Any) -> None:
    async with gateway(answer, dispatch={"breaker_failures": 1}) as (gw, _), beside(gw):
        r = await in_thread(_call, gw.url, hostile_request())
        breaker = gw.gateway.fleet.get("hostile").breaker.state(gw.gateway.clock()).value
    assert r.status_code == 502, r.text[:300]
    assert breaker == "open"  # the instance's doing: it counts against it


def _speaks_for_the_gateway(sock: socket.socket, head: bytes, body: bytes) -> None:
    extra = (
        b"x-taogate-instance: forged\r\nX-Taogate-Other: forged\r\nconnection: close, X-Hop\r\n"
        b"x-hop: 1\r\nset-cookie: session=steal\r\nstrict-transport-security: max-age=31536000\r\n"
        b'alt-svc: h3=":443"\r\nproxy-authenticate: Basic\r\nx-kept: yes\r\n'
    )
    payload = completion()
    sock.sendall(
        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
        + extra
        + b"transfer-encoding: chunked\r\n\r\n"
        b"%x\r\n%s\r\n0\r\nx-trailer: t\r\nx-taogate-instance: trailer\r\n\r\n" % (len(payload), payload)
    )


async def test_an_instance_cannot_speak_for_the_gateway_or_its_origin() -> None:
    async with gateway(_speaks_for_the_gateway) as (gw, _), beside(gw):
        r = await in_thread(_call, gw.url, hostile_request())
    assert r.status_code == 200
    assert r.headers.get_list("x-taogate-instance") == ["hostile"]
    for name in ("x-taogate-other", "x-hop", "set-cookie", "strict-transport-security", "alt-svc"):
        assert name not in r.headers, name
    assert "proxy-authenticate" not in r.headers and "x-trailer" not in r.headers
    assert r.headers["x-kept"] == "yes"
