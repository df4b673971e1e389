"""Hostile clients against ``taogate serve``'s protocol and limits: huge or endless heads, silent and
slow connections, too many connections, trickled bodies, prompts of millions of tiny items,
redirects, hop-by-hop headers and trailers. Each attack runs beside a normal client
(``helpers.beside``)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import resource
import socket
import time
from pathlib import Path
from typing import Any

import orjson
import pytest

from tests.hostile.helpers import (
    AUTH,
    HOSTILE,
    answer_json,
    beside,
    connect,
    gateway,
    head_and_body,
    in_thread,
    post_head,
    read_all,
    status_of,
    trickle,
)

pytestmark = pytest.mark.timeout(90)


def _error(response: bytes) -> tuple[int, dict[str, list[str]], dict[str, Any]]:
    headers, body = head_and_body(response)
    assert body, response[:300]
    return status_of(response), headers, json.loads(body)["error"]


def _ask(gw: Any, request: bytes) -> bytes:
    with connect(gw) as sock:
        sock.sendall(request)
        return read_all(sock)


def _huge_header(gw: Any, size: int) -> int:
    """One header value of ``size`` bytes in 64 KiB writes; how much the gateway took."""
    sent = 0
    with connect(gw, timeout=30) as sock:
        try:
            sock.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\nx-big: ")
            piece = b"a" * 65536
            while sent < size:
                sock.sendall(piece)
                sent += len(piece)
            sock.sendall(b"\r\nconnection: close\r\n\r\n")
            read_all(sock)
        except OSError:
            pass
    return sent


async def test_a_huge_request_header_costs_its_neighbours_nothing() -> None:
    async with gateway() as (gw, _), beside(gw):
        sent = await in_thread(_huge_header, gw, 64 << 20)
    assert sent < 16 << 20  # the gateway hung up long before the end


def _fields(n: int) -> str:
    """A head of exactly ``n`` header fields (host and connection included)."""
    return "host: x\r\n" + "".join(f"x-h{i}: v\r\n" for i in range(n - 2)) + "connection: close\r\n"


async def test_head_limits_answer_431_and_414_in_the_openai_shape() -> None:
    async with gateway() as (gw, _), beside(gw):
        ok = await in_thread(_ask, gw, f"GET /health HTTP/1.1\r\n{_fields(100)}\r\n".encode())
        assert status_of(ok) == 200
        status, headers, error = _error(
            await in_thread(_ask, gw, f"GET /health HTTP/1.1\r\n{_fields(101)}\r\n".encode())
        )
        assert (status, error["code"], headers["connection"]) == (431, "too_many_headers", ["close"])
        big = "v" * (70 << 10)
        request = f"GET /health HTTP/1.1\r\nx: {big}\r\n\r\n".encode()
        status, _, error = _error(await in_thread(_ask, gw, request))
        assert (status, error["code"], error["type"]) == (431, "header_too_large", "invalid_request_error")
        url = "/health?" + "q" * (9 << 10)
        status, _, error = _error(
            await in_thread(_ask, gw, f"GET {url} HTTP/1.1\r\nhost: x\r\n\r\n".encode())
        )
        assert (status, error["code"]) == (414, "uri_too_long")
        status, _, error = _error(await in_thread(_ask, gw, b"GARBAGE\r\n\r\n"))
        assert (status, error["code"]) == (400, "invalid_http_request")


def _upgrade_then(gw: Any, body: bytes) -> bytes:
    """A request asking to switch protocols whose body is itself a request, the rest later."""
    smuggled = b"GET /smuggled HTTP/1.1\r\nhost: x\r\n\r\n"
    head = (
        b"POST /v1/completions HTTP/1.1\r\nhost: x\r\nupgrade: h2c\r\nconnection: upgrade\r\n"
        b"content-length: %d\r\n\r\n" % (len(body) + len(smuggled))
    )
    with connect(gw) as sock:
        sock.sendall(head + body)
        time.sleep(0.2)
        with contextlib.suppress(OSError):  # refused and closed already
            sock.sendall(smuggled)
        return read_all(sock)


async def test_an_upgrade_request_s_body_is_never_read_as_another_request() -> None:
    """httptools hands what follows an Upgrade request's head to the new protocol: a body there
    would be dropped, or parsed as a request of its own. Such a request is refused; one without a
    body is served as HTTP/1.1 (a server may ignore Upgrade)."""
    async with gateway() as (gw, _), beside(gw):
        for body in (b"", b"ab"):
            answer = await in_thread(_upgrade_then, gw, body)
            status, headers, error = _error(answer)
            assert (status, error["code"], headers["connection"]) == (400, "upgrade_with_body", ["close"])
            assert answer.count(b"HTTP/1.1 ") == 1, answer
        plain = b"GET /health HTTP/1.1\r\nhost: x\r\nupgrade: h2c\r\nconnection: upgrade, close\r\n\r\n"
        assert status_of(await in_thread(_ask, gw, plain)) == 200


def _timed(fn: Any, *args: Any) -> tuple[float, Any]:
    t = time.perf_counter()
    out = fn(*args)
    return time.perf_counter() - t, out


def _silent(gw: Any) -> tuple[float, bytes]:
    with connect(gw) as sock:
        return _timed(read_all, sock)


def _slow_head(gw: Any) -> tuple[float, bytes]:
    with connect(gw) as sock:
        t = time.perf_counter()
        trickle(sock, b"GET /health HTTP/1.1\r\nhost: x\r\nx-slow: " + b"a" * 200, 1, 0.05)
        answer = read_all(sock)
        return time.perf_counter() - t, answer


def _one_byte_after_a_response(gw: Any, byte: bytes = b"G") -> tuple[float, bytes]:
    with connect(gw) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
        assert status_of(sock.recv(65536)) == 200
        sock.sendall(byte)
        return _timed(read_all, sock)


async def test_silent_and_slow_connections_time_out() -> None:
    async with gateway(gateway={"header_timeout": 0.5}) as (gw, _), beside(gw):
        took, answer = await in_thread(_silent, gw)
        assert took < 2.0 and answer == b""  # closed, nothing said to a connection that said nothing
        took, answer = await in_thread(_slow_head, gw)
        status, headers, error = _error(answer)
        assert (status, error["code"], headers["connection"]) == (408, "header_timeout", ["close"])
        assert took < 2.0
        took, answer = await in_thread(_one_byte_after_a_response, gw)
        assert status_of(answer) == 408 and took < 2.0
    # A line end between requests begins none: the keep-alive wait goes on, and ends the connection.
    async with gateway(gateway={"header_timeout": 0.5, "keepalive_timeout": 0.5}) as (gw, _), beside(gw):
        took, answer = await in_thread(_one_byte_after_a_response, gw, b"\r\n")
        assert answer == b"" and took < 2.0


async def test_past_the_connection_cap_idle_connections_make_room_for_new_clients() -> None:
    """With the open-file limit just above what the cap needs, 40 silent connections would exhaust
    it; at the cap the longest-idle ones are closed instead, and new clients are served."""
    cap, silent = 16, 40
    async with gateway(gateway={"max_client_connections": cap, "header_timeout": 30}) as (gw, _):
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        opened = len(await in_thread(lambda: list(Path("/proc/self/fd").iterdir())))
        socks: list[socket.socket] = []
        # the silent clients' own sockets + the cap's + the neighbour, the admin call and the hops
        resource.setrlimit(resource.RLIMIT_NOFILE, (opened + silent + cap + 32, hard))
        try:
            async with beside(gw):
                for _ in range(silent):
                    socks.append(await in_thread(connect, gw))
                    await asyncio.sleep(0.005)
                request = (
                    f"GET /admin/instances HTTP/1.1\r\nhost: x\r\nauthorization: {AUTH['authorization']}"
                    "\r\nconnection: close\r\n\r\n"
                ).encode()
                assert status_of(await in_thread(_ask, gw, request)) == 200
                assert len([s for s in socks if _closed(s)]) >= silent - cap
        finally:
            for s in socks:
                s.close()
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def _closed(sock: socket.socket) -> bool:
    sock.setblocking(False)
    try:
        return sock.recv(1, socket.MSG_PEEK) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def _trickle_body(gw: Any, size: int, pause: float) -> tuple[float, bytes]:
    payload = b'{"model": "emulated-model", "prompt": "' + b"a" * size + b'"}'
    with connect(gw, timeout=10) as sock:
        t = time.perf_counter()
        sock.sendall(post_head("/v1/completions", len(payload)))
        trickle(sock, payload, 1024, pause)
        answer = read_all(sock)
        return time.perf_counter() - t, answer


async def test_a_trickled_body_gets_408_within_the_body_timeout() -> None:
    async with gateway(gateway={"body_timeout": 1.0}) as (gw, _), beside(gw):
        results = await asyncio.gather(*(in_thread(_trickle_body, gw, 1 << 20, 0.05) for _ in range(8)))
    for took, answer in results:
        status, headers, error = _error(answer)
        assert (status, error["code"], headers["connection"]) == (408, "body_timeout", ["close"])
        assert took < 3.0


def _refused_then_more(gw: Any) -> tuple[bytes, float]:
    """A POST without a key declaring a huge body, sending 4 MiB of it, then nothing: the answer,
    and how long the gateway kept the connection after the last byte."""
    head = b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 1000000000\r\n\r\n"
    with connect(gw, timeout=20) as sock:
        sock.sendall(head)
        answer = sock.recv(65536)
        sock.sendall(b"x" * (4 << 20))
        t = time.perf_counter()
        rest = read_all(sock)
        return answer + rest, time.perf_counter() - t


async def test_a_body_left_unread_by_a_refusal_is_discarded_for_a_bounded_while() -> None:
    async with gateway() as (gw, _), beside(gw):
        answer, held = await in_thread(_refused_then_more, gw)
    status, headers, error = _error(answer)
    assert (status, error["code"], headers["connection"]) == (401, "invalid_api_key", ["close"])
    assert held < 10.0  # the listener's lingering close: seconds without a byte end it


def _post(gw: Any, path: str, payload: bytes) -> bytes:
    with connect(gw, timeout=30) as sock:
        sock.sendall(post_head(path, len(payload), "connection: close") + payload)
        return read_all(sock)


TEXT_PART = {"type": "text", "text": "a"}
HI = {"role": "user", "content": "hi"}


@pytest.mark.parametrize(
    ("path", "payload", "status"),
    [
        # just under the default max_json_items: read, measured and keyed, then no instance serves it
        ("/v1/completions", {"prompt": ["w"] * 990_000}, 404),
        ("/v1/chat/completions", {"messages": [HI] * 490_000}, 404),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": [TEXT_PART] * 490_000}]}, 404),
        ("/v1/responses", {"input": [HI] * 490_000}, 404),
        # the shapes that used to take seconds: refused before they are parsed
        ("/v1/completions", {"prompt": ["w"] * 5_000_000}, 400),
        ("/v1/chat/completions", {"messages": [HI] * 900_000}, 400),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": [TEXT_PART] * 1_000_000}]}, 400),
        ("/v1/chat/completions", {"messages": [{}] * 10_000_000}, 400),
    ],
    ids=[
        "990k-prompt-items",
        "490k-messages",
        "490k-content-parts",
        "490k-responses-items",
        "5M-prompt-items",
        "900k-messages",
        "1M-content-parts",
        "10M-empty-objects",
    ],
)
async def test_prompts_of_millions_of_tiny_items_cost_their_neighbours_nothing(
    path: str, payload: dict[str, Any], status: int
) -> None:
    body = orjson.dumps({"model": "no-such-model", **payload})
    async with gateway() as (gw, _), beside(gw):
        answer = await in_thread(_post, gw, path, body)
        del body
    assert status_of(answer) == status, answer[:300]
    if status == 400:
        assert _error(answer)[2]["code"] == "too_many_items"


async def test_trailing_slashes_are_404_and_never_a_redirect_built_from_the_host() -> None:
    async with gateway() as (gw, _), beside(gw):
        for method, path in [
            ("GET", "/admin/instances/"),
            ("GET", "/api/admin/instances/"),
            ("GET", "/v1/models/"),
            ("GET", "/metrics/"),
            ("POST", "/v1/chat/completions/"),
        ]:
            request = f"{method} {path} HTTP/1.1\r\nhost: evil.example\r\ncontent-length: 0\r\n"
            answer = await in_thread(_ask, gw, (request + "connection: close\r\n\r\n").encode())
            headers, _ = head_and_body(answer)
            assert status_of(answer) == 404 and "location" not in headers, (path, answer[:300])


def _chunked_with_trailers(gw: Any, extra: str) -> bytes:
    payload = orjson.dumps({"model": HOSTILE, "prompt": "hi", "max_tokens": 1})
    head = (
        f"POST /v1/completions HTTP/1.1\r\nhost: x\r\nauthorization: {AUTH['authorization']}\r\n"
        f"content-type: application/json\r\ntransfer-encoding: chunked\r\n{extra}\r\n"
    ).encode()
    chunk = b"%x\r\n%s\r\n" % (len(payload), payload)
    trailers = b"0\r\nx-trailer: t\r\nauthorization: Bearer smuggled\r\n\r\n"
    return _ask(gw, head + chunk + trailers)


async def test_hop_by_hop_headers_and_trailers_never_go_upstream() -> None:
    def answer(sock: socket.socket, head: bytes, body: bytes) -> None:
        sock.sendall(answer_json(b"connection: close\r\n"))

    async with gateway(answer) as (gw, scripted), beside(gw):
        assert scripted is not None
        extra = (
            "connection: keep-alive, X-Private\r\nx-private: 1\r\nx-taogate-instance: forged\r\n"
            "connection: close\r\n"
        )
        answered = await in_thread(_chunked_with_trailers, gw, extra)
        assert status_of(answered) == 200, answered[:300]
        [sent] = scripted.heads
        lower = sent.lower()
        for name in (b"x-private", b"x-trailer", b"smuggled", b"x-taogate-", b"transfer-encoding"):
            assert name not in lower, sent


async def test_a_content_encoding_the_gateway_cannot_read_is_415() -> None:
    async with gateway() as (gw, _), beside(gw):
        payload = b'{"model": "emulated-model", "prompt": "hi"}'
        request = post_head("/v1/completions", len(payload), "content-encoding: gzip", "connection: close")
        status, headers, error = _error(await in_thread(_ask, gw, request + payload))
        assert (status, error["code"]) == (415, "unsupported_content_encoding")
        assert headers["accept-encoding"] == ["identity"]
        request = post_head(
            "/v1/completions", len(payload), "content-encoding: identity", "connection: close"
        )
        assert status_of(await in_thread(_ask, gw, request + payload)) == 200


async def test_line_separators_in_client_fields_never_split_an_access_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="taogate.access")
    lines: list[str] = []
    for fmt in ("text", "json"):
        async with gateway(gateway={"log_format": fmt}, access_sink=lines.append) as (gw, _), beside(gw):
            payload = orjson.dumps({"model": "m\u2028odel\x85\u2029x", "prompt": "hi"})
            request = post_head("/v1/completions", len(payload), "x-request-tag: a\x85b", "connection: close")
            assert status_of(await in_thread(_ask, gw, request.replace(b"\xc2", b"") + payload)) == 404
    assert len([line for line in lines if "u2028" in line]) == 2  # the neighbours' lines besides
    for line in lines:
        assert len(line.splitlines()) == 1, line
