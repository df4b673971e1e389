"""Prefix key → preferred instance, by rendezvous (highest-random-weight) hashing.

Every instance gets a pseudo-random score per key; the key prefers the highest scorer. When an
instance leaves, only the keys it won move (each to its own runner-up), and when one joins, it takes
only the keys it now wins: about 1/N of them. A modulo hash would reshuffle almost every key, and
with it every instance's prefix cache, each time health flaps. No ring or table to maintain: the
mapping is a pure function of the key and the current names.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

__all__ = ["rendezvous", "score"]


def score(key: int, name: str) -> int:
    """The instance's weight for this key: a 64-bit hash of both."""
    h = hashlib.blake2b(digest_size=8, person=b"taogate-hrw")
    h.update((key & 0xFFFF_FFFF_FFFF_FFFF).to_bytes(8, "big"))
    h.update(name.encode())
    return int.from_bytes(h.digest(), "big")


def rendezvous(key: int, names: Iterable[str]) -> str | None:
    """The name with the highest score for ``key`` (ties by name, so the result is deterministic)."""
    best: tuple[int, str] | None = None
    for name in names:
        candidate = (score(key, name), name)
        if best is None or candidate > best:
            best = candidate
    return None if best is None else best[1]
