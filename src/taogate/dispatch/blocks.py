"""vLLM's prefix-cache block hashes, reproduced: what a gateway needs to name the blocks an engine holds.

vLLM (default ``prefix_caching_hash_algo = "sha256"``) hashes each *full* block of ``block_size``
token ids into a chain::

    h_-1 = sha256(pickle("vllm-none-hash"))            # the seed; PYTHONHASHSEED replaces the string
    h_i  = sha256(pickle((h_{i-1}, tuple(tokens of block i), None)))

and publishes the low 64 bits of each digest (``int.from_bytes(digest, "big") & 2**64 - 1``) in its
KV-cache events. With the same token ids a gateway computes the same numbers, so an index of the
events can be looked up with a request's own blocks. A request never hits its last token (vLLM
recomputes it for the logits): at most ``(len(tokens) - 1) // block_size`` blocks can hit.

The events' ZMQ publisher binds a wildcard, IPv6 or ipc/inproc endpoint and connects to any other
(``publisher_binds``); its subscriber does the opposite.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Sequence
from functools import lru_cache
from typing import Final

__all__ = ["DEFAULT_SEED", "block_digests", "block_hashes", "max_hit_blocks", "publisher_binds", "wire"]

DEFAULT_SEED: Final = "vllm-none-hash"
_LOW64: Final = (1 << 64) - 1
_PROTOCOL: Final = pickle.HIGHEST_PROTOCOL


def _sha(value: object) -> bytes:
    return hashlib.sha256(pickle.dumps(value, protocol=_PROTOCOL)).digest()


@lru_cache(maxsize=8)
def _seed(seed: str) -> bytes:
    return _sha(seed)


def wire(digest: bytes) -> int:
    """The 64-bit value vLLM publishes for a block's 32-byte digest."""
    return int.from_bytes(digest, "big") & _LOW64


def block_digests(
    token_ids: Sequence[int], block_size: int, parent: bytes | None = None, seed: str = DEFAULT_SEED
) -> list[bytes]:
    """The chain's full digests over every full block of ``token_ids``, continuing from ``parent``
    (the digest of the block before them; None: they start the prompt)."""
    prev = _seed(seed) if parent is None else parent
    out: list[bytes] = []
    ids = token_ids if isinstance(token_ids, list | tuple) else list(token_ids)
    for start in range(0, len(ids) - block_size + 1, block_size):
        prev = _sha((prev, tuple(ids[start : start + block_size]), None))
        out.append(prev)
    return out


def block_hashes(token_ids: Sequence[int], block_size: int, seed: str = DEFAULT_SEED) -> list[int]:
    """vLLM's wire hash of every full block of ``token_ids`` (a trailing partial block has none)."""
    return [wire(d) for d in block_digests(token_ids, block_size, seed=seed)]


def publisher_binds(endpoint: str) -> bool:
    """vLLM's rule for its KV-events socket: bind wildcard, IPv6 and ipc/inproc, connect otherwise."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def max_hit_blocks(num_tokens: int, block_size: int) -> int:
    """Blocks of a ``num_tokens`` prompt that a prefix-cache hit can cover (never its last token)."""
    return max(0, num_tokens - 1) // block_size if block_size > 0 else 0
