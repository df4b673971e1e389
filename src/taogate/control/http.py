"""The control plane's HTTP client: probes, scrapes, warm-up prefills and admin calls.

Plain httpx, over a small pool of its own: a probe must never wait behind proxied requests for a
connection (a saturated proxy pool would make healthy instances fail their probes), and at probe
rates a general client costs nothing worth measuring.
"""

from __future__ import annotations

import ssl

import httpx

from taogate.settings import GatewaySettings

__all__ = ["control_client", "control_timeouts"]


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
