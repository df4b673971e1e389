"""The control plane's HTTP clients, each over a small pool of its own: a probe or a scrape must
never wait behind proxied requests for a connection (a saturated proxy pool would make healthy
instances fail their probes).

Probes, warm-up prefills and admin calls run on plain httpx: at their rates a general client costs
nothing worth measuring. The engine scrapes, a GET of every instance's ``/metrics`` every second,
run on ``h1`` (``Fetcher``): on httpx they were most of a resting gateway's CPU, growing with the
fleet (benchmarks/README.md, 2026-12-06, night).
"""

from __future__ import annotations

import ssl

import httpx

from taogate import h1
from taogate.gateway_settings import GatewaySettings

__all__ = ["Fetcher", "control_client", "control_timeouts", "fetch_limits"]

_FETCH_CONNECTIONS = 32


def control_timeouts(cfg: GatewaySettings) -> httpx.Timeout:
    return httpx.Timeout(
        connect=cfg.connect_timeout,
        read=cfg.request_timeout,
        write=cfg.write_timeout,
        pool=cfg.request_timeout,
    )


def control_client(cfg: GatewaySettings) -> httpx.AsyncClient:
    # Idle connections are let go well before vLLM's uvicorn closes them (5 s), as on the proxy pool.
    # The system's CAs, as the proxied hop trusts them (httpx alone would use certifi's bundle and
    # ignore SSL_CERT_FILE), so a private CA is configured once, the way OpenSSL is told everywhere.
    return httpx.AsyncClient(
        timeout=control_timeouts(cfg),
        verify=ssl.create_default_context(),
        limits=httpx.Limits(max_connections=32, max_keepalive_connections=32, keepalive_expiry=2.5),
        trust_env=False,
    )


def fetch_limits(cfg: GatewaySettings) -> h1.Limits:
    """The fetcher's bounds: the hop's connect timeout and reply-head bounds; each call bounds its
    own read (``Fetcher.get``'s ``within``)."""
    return h1.Limits(
        connect_timeout=cfg.connect_timeout,
        read_timeout=None,
        pool_timeout=cfg.request_timeout,
        max_header_bytes=cfg.max_response_header_bytes,
        max_headers=cfg.max_response_headers,
    )


class Fetcher:
    """Whole GETs to the instances, on an ``h1`` pool of the control plane's own; ``limits`` is
    set again on a reload (the open connections stay)."""

    def __init__(self, cfg: GatewaySettings) -> None:
        limits = fetch_limits(cfg)
        self.pool = h1.Pool(
            _FETCH_CONNECTIONS,
            connect_timeout=limits.connect_timeout,
            read_timeout=limits.read_timeout,
            pool_timeout=limits.pool_timeout,
            keepalive=2.5,  # let go well before vLLM's uvicorn closes an idle connection (5 s)
            max_header_bytes=limits.max_header_bytes,
            max_headers=limits.max_headers,
        )

    @property
    def limits(self) -> h1.Limits:
        return self.pool.limits

    @limits.setter
    def limits(self, limits: h1.Limits) -> None:
        self.pool.limits = limits

    async def get(
        self, base_url: str, path: bytes, headers: list[tuple[bytes, bytes]], *, limit: int, within: float
    ) -> tuple[int, bytes]:
        """(status, body) of ``GET base_url + path``: at most ``limit`` bytes, all in within
        ``within`` seconds. ``h1.H1Error`` when there is no whole answer; ValueError for a URL
        that is not http(s)."""
        r = await self.pool.request(h1.Origin.parse(base_url), path, headers, b"", b"GET")
        try:
            return r.status_code, await r.aread(limit, within)
        finally:
            r.close()

    async def aclose(self) -> None:
        await self.pool.aclose()
