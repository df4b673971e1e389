"""Helpers for the client-key tests (not a test module): a gateway with named keys in front of
emulated instances, all on 127.0.0.1, and the keys' secrets as their env vars."""

from __future__ import annotations

import signal
import socket
import subprocess
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any

import openai

from taogate.app import RunningGateway, create_app
from taogate.serving import serve_asgi
from taogate.settings import Settings
from tests.conftest import ENV, KEY, gateway_settings

MODEL = "emulated-model"
SECRETS = {"TEAM_A_KEY": "team-a-secret", "TEAM_B_KEY": "team-b-secret", "TEAM_C_KEY": "team-c-secret"}


def keyed_settings(
    urls: Sequence[str], keys: list[dict[str, Any]], limits: dict[str, Any] | None = None, **sections: Any
) -> Settings:
    settings = gateway_settings(urls, **sections)
    settings.keys = keys  # type: ignore[assignment]  # validated on assignment
    if limits is not None:
        settings.limits = limits  # type: ignore[assignment]
    return settings


@asynccontextmanager
async def keyed_gateway(
    settings: Settings,
    *,
    access: list[str] | None = None,
    settings_source: Callable[[], Settings] | None = None,
) -> AsyncIterator[RunningGateway]:
    app = create_app(
        settings,
        environ={**ENV, **SECRETS},
        access_sink=access.append if access is not None else None,
        settings_source=settings_source,
    )
    async with serve_asgi(app) as served:
        yield RunningGateway(served.url, KEY, app)


def sdk(gw: RunningGateway, key: str, **kwargs: Any) -> openai.AsyncOpenAI:
    options: dict[str, Any] = {"max_retries": 0, "timeout": 30, **kwargs}
    return openai.AsyncOpenAI(base_url=gw.api_base, api_key=key, **options)


async def chat(client: openai.AsyncOpenAI, max_tokens: int = 3, **extra: Any) -> Any:
    return await client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "hello there"}], max_tokens=max_tokens, **extra
    )


async def chat_once(gw: RunningGateway, key: str, max_tokens: int = 3, **kwargs: Any) -> Any:
    """One chat request with a client of its own, closed after."""
    async with sdk(gw, key, **kwargs) as client:
        return await chat(client, max_tokens)


class RedisServer:
    """Debian's redis-server on a free loopback port, no persistence; stopped, killed and restarted
    on the same port by the tests."""

    def __init__(self, binary: str) -> None:
        self.binary = binary
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        sock.close()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        args = [
            self.binary,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
        ]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # bounded: until it answers PING
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as conn:
                    conn.sendall(b"PING\r\n")
                    if conn.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                time.sleep(0.02)
        raise RuntimeError(f"redis-server did not answer on port {self.port}")

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(5)
            self.proc = None

    def pause(self, paused: bool) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP if paused else signal.SIGCONT)
