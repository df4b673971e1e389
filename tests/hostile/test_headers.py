"""Headers that used to pass through: an instance's ``X-Powered-By`` (what it runs on is no client's
business) and the client's ``X-Forwarded-For`` (forwarded as a proxy does: the address the
gateway saw appended, so the instance can tell the claim from the fact)."""

from __future__ import annotations

import socket

import httpx
import pytest

from tests.hostile.helpers import AUTH, answer_json, beside, gateway, hostile_request, in_thread

pytestmark = pytest.mark.timeout(90)


def _powered(sock: socket.socket, head: bytes, body: bytes) -> None:
    sock.sendall(answer_json(b"x-powered-by: PHP/5.4\r\nconnection: close\r\n"))


def _call(url: str, headers: dict[str, str]) -> httpx.Response:
    with httpx.Client(headers={**AUTH, **headers}, timeout=20) as client:
        return client.post(url + "/v1/completions", json=hostile_request())


async def test_x_powered_by_is_dropped_and_x_forwarded_for_gets_the_client_appended() -> None:
    async with gateway(_powered) as (gw, scripted), beside(gw):
        assert scripted is not None
        claimed = await in_thread(_call, gw.url, {"x-forwarded-for": "6.6.6.6"})
        plain = await in_thread(_call, gw.url, {})
    for r in (claimed, plain):
        assert r.status_code == 200 and "x-powered-by" not in r.headers, r.headers
    forwarded = [
        [
            line.split(b":", 1)[1].strip()
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"x-forwarded-for:")
        ]
        for head in scripted.heads
    ]
    assert forwarded == [[b"6.6.6.6, 127.0.0.1"], [b"127.0.0.1"]]
