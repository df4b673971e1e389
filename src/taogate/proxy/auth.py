"""The unified key: one bearer token for every client, compared in constant time.

The client's key authenticates to taogate only: it is never forwarded upstream (each instance gets
its own configured key, or none) and never logged. On the Anthropic routes it may also come as
``x-api-key``: Claude Code sends its ``ANTHROPIC_API_KEY`` there (and a bearer token for
``ANTHROPIC_AUTH_TOKEN``), the Anthropic SDK sends a bearer token for both.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable

from taogate.errors import Unauthorized

#: Request headers that carry credentials or describe the client hop; never forwarded upstream.
CREDENTIAL_HEADERS = frozenset({b"authorization", b"proxy-authorization", b"x-api-key", b"api-key"})


class KeyCheck:
    """Checks ``Authorization: Bearer <key>`` against the unified key (and the admin key)."""

    __slots__ = ("_admin", "_expected", "_key")

    def __init__(self, key: str, admin_key: str | None = None) -> None:
        self._key = key.encode()
        self._expected = b"Bearer " + self._key
        self._admin = b"Bearer " + (admin_key or key).encode()

    def check_request(self, headers: list[tuple[bytes, bytes]], *, either: bool) -> None:
        """The unified key as a bearer token, or with ``either`` also as ``x-api-key``."""
        if either:
            self.check_either(header(headers, b"authorization"), header(headers, b"x-api-key"))
        else:
            self.check(header(headers, b"authorization"))

    def check_either(self, authorization: bytes | None, api_key: bytes | None) -> None:
        """Raise Unauthorized unless ``x-api-key`` or the bearer token carries the unified key."""
        if api_key is not None and hmac.compare_digest(api_key, self._key):
            return
        if authorization is None and api_key is None:
            raise Unauthorized(
                "Missing API key: send 'x-api-key: <key>' or 'Authorization: Bearer <key>' with the "
                "unified key."
            )
        if authorization is None or not hmac.compare_digest(authorization, self._expected):
            raise Unauthorized("Incorrect API key: taogate accepts only its unified key.")

    def check(self, authorization: bytes | None) -> None:
        """Raise Unauthorized unless the header carries the unified key."""
        if authorization is None:
            raise Unauthorized("Missing API key: send 'Authorization: Bearer <key>' with the unified key.")
        if not hmac.compare_digest(authorization, self._expected):
            raise Unauthorized("Incorrect API key: taogate accepts only its unified key.")

    def check_admin(self, authorization: bytes | None) -> None:
        if authorization is None or not hmac.compare_digest(authorization, self._admin):
            raise Unauthorized("Admin endpoints need the admin key (or the unified key when none is set).")


def header(headers: Iterable[tuple[bytes, bytes]], name: bytes) -> bytes | None:
    """First value of a header in an ASGI header list (names are lower-case there)."""
    for k, v in headers:
        if k == name:
            return v
    return None
