"""The proxied hop's attacks, as rows of ``benchmarks/hostile.py``'s table (not a test module):
percent-encoded CR LF, NUL and space in a stored response's path, and answers that fail after
60 MiB. Each attack is (gateway url) → what the attacker saw."""

from __future__ import annotations

import socket
import threading

import httpx

from tests.hostile.helpers import AUTH, HOSTILE, answer_json
from tests.hostile.test_transport import big_then_silent

INJECTED = [
    "/v1/responses/x%0d%0aX-Injected:%20yes%0d%0aX-P:%20/cancel",
    "/v1/responses/x%00y",
    "/v1/responses/x%20HTTP%2F1.1%0d%0aX-Injected:%20yes",
]


def echo_injection(sock: socket.socket, head: bytes, body: bytes) -> None:
    """Answers whether the request's head carried an injected header or a NUL."""
    injected = b"x-injected" in head.lower().split(b"\r\n", 1)[1] or b"\x00" in head
    sock.sendall(answer_json(payload=b'{"injected":%s}' % (b"true" if injected else b"false")))


def injection(url: str) -> str:
    with httpx.Client(headers=AUTH, timeout=30) as http:
        answers = [http.post(url + path) for path in INJECTED * 10]
    reached = [r for r in answers if r.status_code == 200]
    smuggled = sum(r.json().get("injected") is True for r in reached)
    return f"{len(answers)} sent, {len(reached)} reached the scripted instance, {smuggled} injected"


#: 60 MiB of chunked JSON, 2 s of silence, then the connection closes (the gateway's
#: ``request_timeout`` is 120 s there: a closed connection fails the same read sooner).
sixty_mib_then_close = big_then_silent(60, silence=2.0)


def failed_answers(url: str, rounds: int = 3, concurrent: int = 8) -> str:
    statuses: list[int] = []
    lock = threading.Lock()
    body = {"model": HOSTILE, "prompt": "hello", "max_tokens": 2}

    def one() -> None:
        with httpx.Client(headers=AUTH, timeout=60) as http:
            status = http.post(url + "/v1/completions", json=body).status_code
        with lock:
            statuses.append(status)

    for _ in range(rounds):
        threads = [threading.Thread(target=one) for _ in range(concurrent)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(90)
    return f"{len(statuses)} requests: " + ", ".join(
        f"{statuses.count(s)}× {s}" for s in sorted(set(statuses))
    )
