"""Attacks shared by the hostile tests and ``benchmarks/hostile.py`` (not a test module): each takes
the gateway's URL, runs in the caller's thread with blocking clients, stops by itself, and says in a
few words what the attacker saw. Scripted instance answers for them are here too."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import openai
import orjson

from tests.conftest import KEY
from tests.hostile.helpers import AUTH, HOSTILE, MODEL, Answer, read_all, status_of, trickle

__all__ = ["Answer"]

SSE_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n"
CHAT_EVENT = (
    b'data: {"id":"c","object":"chat.completion.chunk","model":"hostile-model","created":1,'
    b'"choices":[{"index":0,"delta":{"content":"a"}}]}\n\n'
)
BOUNDARY = "hostileboundary"
MODEL_FIELD = f'--{BOUNDARY}\r\ncontent-disposition: form-data; name="model"\r\n\r\n{HOSTILE}\r\n'
FILE_START = (
    f'--{BOUNDARY}\r\ncontent-disposition: form-data; name="file"; filename="a.wav"\r\n'
    "content-type: audio/wav\r\n\r\nRIFF"
)


def _tally(items: list[Any]) -> str:
    return ", ".join(f"{k} ×{n}" for k, n in Counter(items).most_common())


def _connect(url: str, timeout: float) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])), timeout=timeout)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def _parallel(n: int, fn: Callable[[int], Any]) -> list[Any]:
    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(fn, range(n)))


# -- scripted instances' answers ---------------------------------------------------------------------
def swallow(sock: socket.socket, head: bytes, body: bytes) -> None:
    """Reads the request (the scripted instance did) and says nothing."""


def cut(events: bytes, fragment: bytes, chunked: bool) -> Answer:
    """Whole ``events``, then ``fragment`` (half an event), then the end: inside a chunk of a
    chunked body (a broken answer), or at the end of an until-close body (a clean end)."""

    def answer(sock: socket.socket, head: bytes, body: bytes) -> None:
        if chunked:
            sock.sendall(SSE_HEAD.replace(b"\r\n\r\n", b"\r\ntransfer-encoding: chunked\r\n\r\n"))
            sock.sendall(b"%x\r\n%s\r\n" % (len(events), events))
            sock.sendall(b"%x\r\n%s" % (len(fragment) + 10, fragment))
        else:
            sock.sendall(SSE_HEAD + events + fragment)
        sock.shutdown(socket.SHUT_WR)

    return answer


cut_inside_an_event = cut(CHAT_EVENT, b'data: {"id":"c","choi', chunked=True)


# -- attacks -----------------------------------------------------------------------------------------
def stalled_upload(
    url: str, start: str, pause: float, drip: int = 20, *, key: str = KEY, extra: str = ""
) -> tuple[float, bytes]:
    """A form head declaring a megabyte (and the header lines ``extra``), then a byte every ``pause``
    s (at most ``drip``): how long until the gateway answered or hung up, and what it said."""
    head = (
        "POST /v1/audio/transcriptions HTTP/1.1\r\nhost: x\r\n"
        f"authorization: Bearer {key}\r\ncontent-length: 1000000\r\n{extra}"
        f"content-type: multipart/form-data; boundary={BOUNDARY}\r\n\r\n"
    )
    with _connect(url, timeout=pause * drip + 30) as sock:
        t = time.perf_counter()
        sock.sendall((head + start).encode())
        trickle(sock, b"a" * drip, 1, pause)
        took = time.perf_counter() - t
        return took, read_all(sock)


def stalled_uploads(url: str) -> str:
    results = _parallel(8, lambda _: stalled_upload(url, MODEL_FIELD + FILE_START, 1.0, 30))
    held = max(took for took, _ in results)
    return f"{_tally([status_of(answer) for _, answer in results])}, held ≤ {held:.1f} s"


def _scrape_for(url: str, seconds: float, pause: float) -> int:
    n = 0
    end = time.monotonic() + seconds
    with httpx.Client(timeout=30) as client:
        while time.monotonic() < end:
            client.get(url + "/metrics").raise_for_status()
            n += 1
            if pause:
                time.sleep(pause)
    return n


def metrics_loops(url: str) -> str:
    scrapes = sum(_parallel(16, lambda _: _scrape_for(url, 5.0, 0)))
    return f"{scrapes:,} scrapes ({scrapes / 5:,.0f}/s)"


def metrics_pollers(url: str) -> str:
    stagger = threading.Lock()

    def poller(i: int) -> int:
        with stagger:
            time.sleep(1 / 300)  # spread their phases over the second
        return _scrape_for(url, 8.0, 1.0)

    scrapes = sum(_parallel(300, poller))
    return f"{scrapes:,} scrapes ({scrapes / 8:,.0f}/s)"


def _sdk_stream(url: str) -> str:
    client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
    try:
        list(
            client.chat.completions.create(
                model=HOSTILE, messages=[{"role": "user", "content": "hi"}], stream=True
            )
        )
    except openai.APIError:
        return "APIError"
    except json.JSONDecodeError:
        return "JSONDecodeError"
    return "no error"


def cut_streams(url: str) -> str:
    return _tally([_sdk_stream(url) for _ in range(20)])


def _post(url: str, path: str, body: bytes) -> int:
    headers = {**AUTH, "content-type": "application/json"}
    with httpx.Client(headers=headers, timeout=60) as client:
        return client.post(url + path, content=body).status_code


def deep_bodies(url: str) -> str:
    deep = b"[" * 1000 + b'"x"' + b"]" * 1000
    history = {"role": "user", "content": "<deep>"}
    body = orjson.dumps({"model": MODEL, "messages": [history, {"role": "user", "content": "q"}]})
    body = body.replace(b'"<deep>"', deep)
    return _tally([_post(url, "/v1/chat/completions", body) for _ in range(40)])


def many_blocks(url: str) -> str:
    blocks = [{"type": "thinking", "thinking": "a"}] * 450_000
    body = orjson.dumps(
        {"model": "no-such-model", "max_tokens": 2, "messages": [{"role": "user", "content": blocks}]}
    )
    return _tally([_post(url, "/v1/messages", body) for _ in range(3)])


def huge_response_ids(url: str) -> str:
    """100 Responses requests, each choosing its own id of a mebibyte."""
    body = orjson.dumps(
        {"model": MODEL, "input": "hi", "max_output_tokens": 2, "request_id": "r" * (1 << 20)}
    )
    return _tally([_post(url, "/v1/responses", body.replace(b'"rrrr', b'"%04d' % i, 1)) for i in range(100)])
