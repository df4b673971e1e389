"""The unified key: one bearer token for every client, compared in constant time.

The client's key authenticates to taogate only: it is never forwarded upstream (each instance gets
its own configured key, or none) and never logged.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable

from taogate.errors import Unauthorized

#: Request headers that carry credentials or describe the client hop; never forwarded upstream.
CREDENTIAL_HEADERS = frozenset({b"authorization", b"proxy-authorization", b"x-api-key", b"api-key"})


class KeyCheck:
    """Checks ``Authorization: Bearer <key>`` against the unified key (and the admin key)."""

    __slots__ = ("_admin", "_expected")

    def __init__(self, key: str, admin_key: str | None = None) -> None:
        self._expected = b"Bearer " + key.encode()
        self._admin = b"Bearer " + (admin_key or key).encode()

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
