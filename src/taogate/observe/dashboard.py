"""``GET /dashboard``: the fleet page, one self-contained file shipped with the package.

The page carries no data: it asks for the admin key in a form of its own, keeps it in the tab's
session storage and polls the admin JSON with it. Polling rather than a server-sent stream because
an EventSource cannot send an Authorization header (the key would have to travel in the URL or a
cookie), and a held stream would keep a graceful shutdown waiting.

Its style and script are inline (nothing to fetch, so it works offline and behind a firewall), and
the Content-Security-Policy allows exactly those two by their hashes and connections to the gateway
itself: an injected script, style or remote fetch is refused by the browser.
"""

from __future__ import annotations

import base64
import hashlib
import re
from functools import cache
from importlib import resources

from fastapi import Request
from fastapi.responses import Response

__all__ = ["dashboard", "page", "security_headers"]

_INLINE = re.compile(r"<(script|style)>(.*?)</\1>", re.DOTALL)


@cache
def page() -> bytes:
    return (resources.files("taogate.observe") / "dashboard.html").read_bytes()


def _hash(source: str) -> str:
    return "'sha256-" + base64.b64encode(hashlib.sha256(source.encode()).digest()).decode() + "'"


@cache
def security_headers() -> dict[str, str]:
    """The page's headers; the CSP names the hash of each inline block, and nothing else runs."""
    html = page().decode()
    scripts = [_hash(body) for kind, body in _INLINE.findall(html) if kind == "script"]
    styles = [_hash(body) for kind, body in _INLINE.findall(html) if kind == "style"]
    csp = "; ".join(
        (
            "default-src 'none'",
            f"script-src {' '.join(scripts)}",
            f"style-src {' '.join(styles)}",
            "connect-src 'self'",
            "img-src 'self' data:",
            "base-uri 'none'",
            "form-action 'none'",
            "frame-ancestors 'none'",
        )
    )
    return {
        "content-security-policy": csp,
        "x-content-type-options": "nosniff",
        "referrer-policy": "no-referrer",
        "x-frame-options": "DENY",
        "cross-origin-opener-policy": "same-origin",
        "cache-control": "no-cache",
    }


async def dashboard(_: Request) -> Response:
    return Response(page(), media_type="text/html; charset=utf-8", headers=security_headers())
