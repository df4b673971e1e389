"""The client keys: the unified one, and the named ones of ``[[keys]]`` (``tenancy.keys``), each
compared in constant time; the check says whose key a request carries.

The client's key authenticates to taogate only: it is never forwarded upstream (each instance gets
its own configured key, or none) and never logged. On the Anthropic routes it may also come as
``x-api-key``: Claude Code sends its ``ANTHROPIC_API_KEY`` there (and a bearer token for
``ANTHROPIC_AUTH_TOKEN``), the Anthropic SDK sends a bearer token for both.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable

from taogate.errors import Unauthorized
from taogate.tenancy.keys import KeyTable, Tenant

#: Request headers that carry credentials or describe the client hop; never forwarded upstream.
CREDENTIAL_HEADERS = frozenset({b"authorization", b"proxy-authorization", b"x-api-key", b"api-key"})


class KeyCheck:
    """Checks a request's ``Authorization: Bearer <key>`` against the unified key, then the named
    keys of ``table`` (``check_request``), and an admin call's against the admin key
    (``check_admin``). The scheme's name is read in any case, as HTTP says."""

    __slots__ = ("_admin", "_key", "table")

    def __init__(self, key: str, admin_key: str | None = None, table: KeyTable | None = None) -> None:
        self._key = key.encode()
        self._admin = (admin_key or key).encode()
        self.table = table if table is not None else KeyTable(Tenant("unified"), {})

    def check_request(self, headers: list[tuple[bytes, bytes]], *, either: bool) -> Tenant:
        """Whose key: the unified key, or a named one, as a bearer token, or with ``either`` also as
        ``x-api-key``; Unauthorized for any other (or none)."""
        authorization = header(headers, b"authorization")
        api_key = header(headers, b"x-api-key") if either else None
        bearer = _bearer(authorization)
        if bearer is not None and hmac.compare_digest(bearer, self._key):
            return self.table.unified
        if api_key is not None and hmac.compare_digest(api_key, self._key):
            return self.table.unified
        if self.table.named:
            presented = bearer if bearer is not None else api_key
            tenant = self.table.find(presented) if presented else None
            if tenant is not None:
                return tenant
        raise _refusal(authorization, api_key, either=either)

    def check_admin(self, authorization: bytes | None) -> None:
        bearer = _bearer(authorization)
        if bearer is None or not hmac.compare_digest(bearer, self._admin):
            raise Unauthorized("Admin endpoints need the admin key (or the unified key when none is set).")


def _bearer(authorization: bytes | None) -> bytes | None:
    """The token of ``Bearer <token>`` (the scheme in any case), else None."""
    if authorization is None or authorization[:7].lower() != b"bearer ":
        return None
    return authorization[7:]


def header(headers: Iterable[tuple[bytes, bytes]], name: bytes) -> bytes | None:
    """First value of a header in an ASGI header list (names are lower-case there)."""
    for k, v in headers:
        if k == name:
            return v
    return None


def _refusal(authorization: bytes | None, api_key: bytes | None, *, either: bool) -> Unauthorized:
    """Why a request carrying no accepted key is refused: no key at all, or a wrong one (the
    messages name the unified key, and with ``either`` both ways of sending it)."""
    if either:
        if authorization is None and api_key is None:
            return Unauthorized(
                "Missing API key: send 'x-api-key: <key>' or 'Authorization: Bearer <key>' with the "
                "unified key."
            )
    elif authorization is None:
        return Unauthorized("Missing API key: send 'Authorization: Bearer <key>' with the unified key.")
    return Unauthorized("Incorrect API key: taogate accepts only its unified key.")
