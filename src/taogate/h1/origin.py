"""Where one instance lives: a base URL parsed once (scheme, host, port, path prefix, basic auth)."""

from __future__ import annotations

import base64
from dataclasses import dataclass
from urllib.parse import unquote, urlsplit

__all__ = ["Origin"]


@dataclass(frozen=True, slots=True)
class Origin:
    """Where one instance lives: parsed once per base URL."""

    scheme: str
    host: str
    port: int
    path: bytes  # the base URL's path ('' or e.g. /prefix), put before each route
    authority: bytes  # the Host header
    basic_auth: bytes | None = None  # from user:password@ in the URL

    @classmethod
    def parse(cls, url: str) -> Origin:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {url!r}")
        if any(c <= " " or c == "\x7f" for c in parts.path):
            raise ValueError(f"a control byte or space in the URL's path: {url!r}")
        port = parts.port or (443 if parts.scheme == "https" else 80)
        host = parts.hostname
        shown = f"[{host}]" if ":" in host else host
        default = port == (443 if parts.scheme == "https" else 80)
        authority = (shown if default else f"{shown}:{port}").encode("idna")
        auth = None
        if parts.username is not None:
            creds = f"{unquote(parts.username)}:{unquote(parts.password or '')}".encode()
            auth = b"Basic " + base64.b64encode(creds)
        return cls(parts.scheme, host, port, parts.path.rstrip("/").encode(), authority, auth)

    @property
    def endpoint(self) -> str:
        """``host:port`` (an IPv6 host bracketed), never the URL's credentials."""
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    @property
    def key(self) -> tuple[str, str, int]:
        return (self.scheme, self.host, self.port)
