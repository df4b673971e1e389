"""The key table: which client a presented key belongs to, found by its SHA-256 digest.

Every key, the unified one too, is stored as ``sha256(key)``; a presented key is hashed once and
looked up in a dict, then its digest compared again with ``hmac.compare_digest``. Why this is
constant-time with respect to the secrets: the only data-dependent work is on the *presented* key's
digest (the dict's SipHash of it and the byte compare of two digests); a timing that reveals how
much of ``sha256(guess)`` matches a stored digest gives no handle on a key, since steering SHA-256's
output towards a digest is a preimage search. Nothing ever compares the secret bytes themselves.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from taogate.key_settings import UNIFIED_KEY, KeySettings
from taogate.settings import ConfigError, Settings

__all__ = ["UNIFIED_KEY", "KeyTable", "Tenant", "digest", "new_key"]


@dataclass(frozen=True, slots=True)
class Tenant:
    """One client key's name and limits (None: no such limit)."""

    name: str
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    max_concurrency: int | None = None
    models: frozenset[str] | None = None
    max_priority: int = 0
    weight: float = 1.0

    @property
    def rate_limited(self) -> bool:
        return self.requests_per_minute is not None or self.tokens_per_minute is not None

    @classmethod
    def from_settings(cls, k: KeySettings) -> Tenant:
        return cls(
            k.name,
            k.requests_per_minute,
            k.tokens_per_minute,
            k.max_concurrency,
            None if k.models is None else frozenset(k.models),
            k.max_priority,
            k.weight,
        )


def digest(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()


def new_key() -> str:
    """A fresh client key: 256 random bits, URL-safe."""
    return "tg-" + secrets.token_urlsafe(32)


class KeyTable:
    """Tenants by key digest; rebuilt whole on reload (added and revoked keys take effect at once)."""

    __slots__ = ("_by_digest", "named", "unified")

    def __init__(self, unified: Tenant, entries: Mapping[bytes, Tenant]) -> None:
        self.unified = unified
        # The stored digest rides along with its tenant, for the final compare_digest.
        self._by_digest = {d: (d, t) for d, t in entries.items()}
        self.named = any(t is not unified for t in entries.values())  # any key besides the unified one

    @classmethod
    def from_settings(cls, settings: Settings, environ: Mapping[str, str], unified_key: str) -> KeyTable:
        """ConfigError names a key whose env var is unset, or two entries with the same key."""
        unified = Tenant(UNIFIED_KEY, max_priority=settings.limits.max_priority)
        entries: dict[bytes, Tenant] = {digest(unified_key.encode()): unified}
        for k in settings.keys:
            if k.key_env is not None:
                secret = environ.get(k.key_env, "")
                if not secret:
                    raise ConfigError(f"[[keys]] {k.name}: key_env names {k.key_env}, which is not set")
                d = digest(secret.encode())
            else:
                d = bytes.fromhex(k.key_sha256 or "")
            if d in entries:
                raise ConfigError(f"[[keys]] {k.name}: the same key as {entries[d].name}: keys must differ")
            entries[d] = Tenant.from_settings(k)
        return cls(unified, entries)

    def find(self, presented: bytes) -> Tenant | None:
        """The tenant whose key this is, or None (see the module docstring for why in constant time)."""
        d = digest(presented)
        found = self._by_digest.get(d)
        if found is None:
            return None
        stored, tenant = found
        return tenant if hmac.compare_digest(d, stored) else None

    def __iter__(self) -> Iterator[Tenant]:
        return (t for _, t in self._by_digest.values())

    def __len__(self) -> int:
        return len(self._by_digest)

    def names(self) -> list[str]:
        return [t.name for t in self]
