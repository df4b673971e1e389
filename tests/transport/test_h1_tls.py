"""The proxied hop over TLS (an overflow channel is usually https): h1.Pool against a loopback TLS
server with a certificate from a test CA, and the whole gateway in front of an https instance."""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import trustme

from taogate import h1
from taogate.emulator.app import create_emulator_app
from taogate.emulator.config import EmulatorConfig
from taogate.serving import serve_asgi
from tests.conftest import KEY, gateway_settings, serve

OK = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}"


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


def server_context(ca: trustme.CA, host: str = "127.0.0.1") -> ssl.SSLContext:
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert(host).configure_cert(ctx)
    return ctx


def client_context(ca: trustme.CA) -> ssl.SSLContext:
    ctx = ssl.create_default_context()
    ca.configure_trust(ctx)
    return ctx


@contextlib.asynccontextmanager
async def tls_server(ctx: ssl.SSLContext) -> AsyncIterator[tuple[h1.Origin, list[bytes]]]:
    """A keep-alive HTTPS server answering ``{}``; yields its origin and the requests it read."""
    seen: list[bytes] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(
                    (
                        int(v)
                        for k, _, v in (ln.partition(b":") for ln in head.split(b"\r\n"))
                        if k == b"content-length"
                    ),
                    0,
                )
                seen.append(head + await reader.readexactly(length))
                writer.write(OK)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, ssl.SSLError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0, ssl=ctx)
    port = server.sockets[0].getsockname()[1]
    try:
        yield h1.Origin.parse(f"https://127.0.0.1:{port}"), seen
    finally:
        server.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(server.wait_closed(), 2)


def pool(ctx: ssl.SSLContext | None) -> h1.Pool:
    return h1.Pool(4, connect_timeout=2.0, read_timeout=5.0, pool_timeout=5.0, ssl_context=ctx)


async def test_requests_over_tls_reuse_one_connection(ca: trustme.CA) -> None:
    async with tls_server(server_context(ca)) as (origin, seen):
        p = pool(client_context(ca))
        try:
            for n in range(3):
                r = await p.request(origin, b"/v1/completions", [(b"x-n", str(n).encode())], b'{"a":1}')
                assert r.status_code == 200 and await r.aread() == b"{}"
            assert p.open_connections == 1  # kept alive across requests, TLS session included
        finally:
            await p.aclose()
    assert len(seen) == 3 and all(req.endswith(b'{"a":1}') for req in seen)
    assert seen[0].startswith(b"POST /v1/completions HTTP/1.1\r\n")


async def test_an_untrusted_certificate_is_a_connect_error(ca: trustme.CA) -> None:
    async with tls_server(server_context(ca)) as (origin, seen):
        p = pool(ssl.create_default_context())  # the system's CAs: they never signed the test CA
        try:
            with pytest.raises(h1.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
                await p.request(origin, b"/health", [], b"")
        finally:
            await p.aclose()
    assert seen == []


async def test_a_certificate_for_another_name_is_a_connect_error(ca: trustme.CA) -> None:
    async with tls_server(server_context(ca, host="instance.example")) as (origin, _):
        p = pool(client_context(ca))
        try:
            with pytest.raises(h1.ConnectError):
                await p.request(origin, b"/health", [], b"")
        finally:
            await p.aclose()


async def test_the_gateway_serves_through_an_https_instance(
    ca: trustme.CA, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A private CA is trusted the way OpenSSL is told everywhere (SSL_CERT_FILE), by the proxied
    hop and the probes alike."""
    cert = ca.issue_cert("127.0.0.1")
    key_file, cert_file, ca_file = tmp_path / "key.pem", tmp_path / "cert.pem", tmp_path / "ca.pem"
    cert.private_key_pem.write_to_path(str(key_file))
    cert.cert_chain_pems[0].write_to_path(str(cert_file))
    ca.cert_pem.write_to_path(str(ca_file))
    monkeypatch.setenv("SSL_CERT_FILE", str(ca_file))
    app = create_emulator_app(EmulatorConfig(prefill_tokens_per_s=200_000, step_overhead=0.001))
    async with serve_asgi(app, ssl_keyfile=str(key_file), ssl_certfile=str(cert_file)) as emu:
        url = emu.url.replace("http://", "https://")
        async with serve(gateway_settings([url])) as gate, httpx.AsyncClient(timeout=30) as http:
            r = await http.post(
                gate.api_base + "/completions",
                json={"model": "emulated-model", "prompt": "hello over tls", "max_tokens": 3},
                headers={"authorization": f"Bearer {KEY}"},
            )
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == 3
            assert r.headers["x-taogate-instance"] == "i0"
