"""What every hostile test checks, and the scripted peers that attack (not a test module).

Each attack runs in a thread with blocking sockets, so its own work is not done on the gateway's
loop. Beside it a neighbour, in a thread too, sends a normal proxied request on a fresh connection
every few ms. After the attack: the neighbour's slowest request took under a second, the process's
RSS grew by less than 64 MiB, and every instance slot is back to zero.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import select
import socket
import socketserver
import threading
import time
from collections.abc import AsyncIterator, Callable
from functools import partial
from pathlib import Path
from typing import Any

import httpx

from taogate.app import RunningGateway, serve_gateway
from taogate.emulator.config import EmulatorConfig
from taogate.emulator.fleet import run_fleet
from tests.conftest import KEY, gateway_settings, wait_until

MODEL = "emulated-model"  # the emulator's: what the neighbour asks for
HOSTILE = "hostile-model"  # only the scripted instance serves it
AUTH = {"authorization": f"Bearer {KEY}"}
NEIGHBOUR_LIMIT_S = 1.0
RSS_LIMIT = 64 << 20


def rss() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class Neighbour(threading.Thread):
    """A normal client: one tiny proxied completion at a time, each on a new connection."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True, name="neighbour")
        self.url = url
        self.latencies: list[float] = []
        self.errors: list[str] = []
        self._done = threading.Event()

    def run(self) -> None:
        body = {"model": MODEL, "prompt": "hello", "max_tokens": 2}
        limits = httpx.Limits(max_keepalive_connections=0)
        with httpx.Client(headers=AUTH, timeout=10, limits=limits) as client:
            while not self._done.is_set():
                t = time.perf_counter()
                try:
                    r = client.post(self.url + "/v1/completions", json=body)
                    if r.status_code != 200:
                        self.errors.append(f"HTTP {r.status_code}: {r.text[:200]}")
                except httpx.HTTPError as exc:
                    self.errors.append(repr(exc))
                self.latencies.append(time.perf_counter() - t)
                self._done.wait(0.02)

    def stop(self) -> None:
        self._done.set()


async def slots_free(gw: RunningGateway) -> None:
    def free() -> bool:
        return gw.gateway.dispatcher.queued == 0 and all(i.inflight == 0 for i in gw.gateway.fleet)

    await wait_until(free, within=10, what="every instance slot back to zero")


@contextlib.asynccontextmanager
async def beside(gw: RunningGateway) -> AsyncIterator[Neighbour]:
    """Run the block (the attack) beside a neighbour, then check what the attack must not cost."""
    before = rss()
    neighbour = Neighbour(gw.url)
    neighbour.start()
    try:
        await wait_until(lambda: bool(neighbour.latencies), within=5, what="the neighbour's first answer")
        yield neighbour
        seen = len(neighbour.latencies)
        await wait_until(lambda: len(neighbour.latencies) > seen, within=5, what="a neighbour after it")
    finally:
        neighbour.stop()
        await asyncio.to_thread(neighbour.join, 15)
    assert not neighbour.errors, neighbour.errors[:5]
    slowest = max(neighbour.latencies)
    assert slowest < NEIGHBOUR_LIMIT_S, f"the slowest neighbour took {slowest:.2f}s"
    grown = rss() - before
    assert grown < RSS_LIMIT, f"RSS grew by {grown / 2**20:.0f} MiB"
    await slots_free(gw)


def in_thread(fn: Callable[..., Any], *args: Any) -> Any:
    """Await ``fn(*args)`` run in a thread (the attack's blocking sockets off the gateway's loop)."""
    return asyncio.to_thread(fn, *args)


def port_of(gw: RunningGateway) -> int:
    return int(gw.url.rsplit(":", 1)[1])


def connect(gw: RunningGateway, timeout: float = 5.0) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port_of(gw)), timeout=timeout)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def read_all(sock: socket.socket, limit: int = 1 << 20) -> bytes:
    """What the peer sends until it closes (or the socket's timeout, or a reset)."""
    out = b""
    with contextlib.suppress(ConnectionError, TimeoutError):
        while len(out) < limit:
            data = sock.recv(65536)
            if not data:
                break
            out += data
    return out


def status_of(response: bytes) -> int:
    return int(response.split(b" ", 2)[1]) if response.startswith(b"HTTP/1.1 ") else 0


def head_and_body(response: bytes) -> tuple[dict[str, list[str]], bytes]:
    head, _, body = response.partition(b"\r\n\r\n")
    headers: dict[str, list[str]] = {}
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        headers.setdefault(name.decode().lower(), []).append(value.strip().decode("latin-1"))
    return headers, body


def post_head(path: str, length: int, *extra: str) -> bytes:
    """A proxied POST's head with the key; ``extra`` header lines."""
    lines = [f"POST {path} HTTP/1.1", "host: x", "content-type: application/json"]
    lines += [f"authorization: Bearer {KEY}", f"content-length: {length}", *extra]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def trickle(sock: socket.socket, data: bytes, piece: int, pause: float) -> None:
    """Send ``data`` ``piece`` bytes at a time, ``pause`` s apart, until the peer answers or hangs up
    (a client that notices the answer, so a reset never hides it)."""
    for i in range(0, len(data), piece):
        try:
            sock.sendall(data[i : i + piece])
        except OSError:
            return
        readable, _, _ = select.select([sock], [], [], pause)
        if readable:
            return


# -- a scripted instance -------------------------------------------------------------------------
Answer = Callable[[socket.socket, bytes, bytes], None]  # (connection, request head, body)


class ScriptedInstance:
    """A vLLM stand-in in a thread: answers health and model probes as vLLM does, and each proxied
    request with ``answer``, then closes the connection. ``heads`` are the proxied requests' heads."""

    def __init__(self, answer: Answer, model: str = HOSTILE) -> None:
        self.answer = answer
        self.model = model
        self.heads: list[bytes] = []
        outer = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                with contextlib.suppress(OSError):
                    outer._connection(self.request)

        self._server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"

    def _connection(self, sock: socket.socket) -> None:
        reader = sock.makefile("rb")
        while True:
            head = b""
            while not head.endswith(b"\r\n\r\n"):
                line = reader.readline(65536)
                if not line:
                    return
                head += line
            length = 0
            for line in head.split(b"\r\n"):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":", 1)[1])
            body = reader.read(length) if length else b""
            target = head.split(b" ", 2)[1]
            if head.startswith(b"GET "):
                if target == b"/health":
                    sock.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
                elif target == b"/v1/models":
                    cards = {"object": "list", "data": [{"id": self.model, "object": "model"}]}
                    payload = json.dumps(cards).encode()
                    sock.sendall(
                        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                        b"content-length: %d\r\n\r\n%s" % (len(payload), payload)
                    )
                else:
                    sock.sendall(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n")
                continue
            self.heads.append(head)
            self.answer(sock, head, body)
            return

    def __enter__(self) -> ScriptedInstance:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()


def completion(text: str = "ok", usage: str = '{"prompt_tokens":1,"completion_tokens":1}') -> bytes:
    head = '{"id":"x","object":"text_completion","choices":[{"text":"' + text + '"}],"usage":'
    return (head + usage + "}").encode()


def answer_json(head: bytes = b"", payload: bytes | None = None) -> bytes:
    """A whole 200 answer; ``head`` adds header lines (each ending in CRLF)."""
    body = completion() if payload is None else payload
    return (
        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
        + head
        + b"content-length: %d\r\n\r\n" % len(body)
    ) + body


def _serves(inst: Any, model: str) -> bool:
    return model in inst.model_cards


@contextlib.asynccontextmanager
async def gateway(
    answer: Answer | None = None,
    *,
    access_sink: Callable[[str], None] | None = None,
    emulators: int = 1,
    emulator: EmulatorConfig | None = None,
    keys: list[dict[str, Any]] | None = None,
    **sections: dict[str, Any],
) -> AsyncIterator[Any]:
    """A gateway in front of instant emulators (``emu``, ``emu2``, ...: the neighbour's) and, with
    ``answer``, a scripted instance serving ``HOSTILE``, with ``keys`` as ``[[keys]]``; yields
    (gateway, scripted instance or None) once all are up."""
    sections.setdefault("dispatch", {})
    sections["dispatch"] = {"scrape_interval": 0, "breaker_failures": 1000, **sections["dispatch"]}
    with contextlib.ExitStack() as stack:
        scripted = stack.enter_context(ScriptedInstance(answer)) if answer is not None else None
        async with run_fleet([emulator or EmulatorConfig(instant=True)] * emulators) as fleet:
            urls = [*fleet.urls, *([scripted.url] if scripted else [])]
            emus = ["emu", *(f"emu{i + 1}" for i in range(1, emulators))]
            names = [*emus, *(["hostile"] if scripted else [])]
            settings = gateway_settings(urls, roles=None, names=names, **sections)
            if keys is not None:
                settings.keys = keys  # type: ignore[assignment]  # validated on assignment
            async with serve_gateway(settings, key=KEY, access_sink=access_sink) as gw:
                if scripted is not None:
                    inst = gw.gateway.fleet.get("hostile")
                    await wait_until(lambda: HOSTILE in inst.model_cards, within=10, what="probes")
                for name in emus:
                    await wait_until(partial(_serves, gw.gateway.fleet.get(name), MODEL), within=10)
                yield gw, scripted


def hostile_request(stream: bool = False) -> dict[str, Any]:
    return {"model": HOSTILE, "prompt": "hello", "max_tokens": 2, "stream": stream}
