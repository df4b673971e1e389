"""KV-cache blocks with vLLM-style automatic prefix caching.

Model (after vLLM v1's ``BlockPool`` / ``KVCacheManager``):

- The cache holds ``num_blocks`` blocks of ``block_size`` tokens. A running request holds the blocks
  covering the tokens it has in the cache (prompt computed so far plus generated tokens).
- With prefix caching on, each *full* prompt block is identified by a hash chain
  ``h_i = hash((h_{i-1}, tokens of block i))``, so a block matches only if the whole prefix before it
  matches too. A request's leading blocks found in the cache are shared (reference counted) and their
  tokens skip prefill.
- Freed blocks go to the tail of an LRU free queue but keep their hash: they stay hits until they are
  reused for new data, which happens from the head (least recently freed first). A request frees its
  blocks tail-first so its prefix outlives its suffix, as vLLM does. Blocks held by running requests
  are never evicted.
- Usage is ``1 - free/total`` where cached-but-unreferenced blocks count as free (vLLM's
  ``kv_cache_usage_perc``).

Only prompt blocks are cached (vLLM also caches full blocks of generated text; for a gateway's view of
prefix reuse the prompt is what matters).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

__all__ = ["BlockPool", "block_hashes"]


def block_hashes(token_ids: Sequence[int], block_size: int) -> list[int]:
    """Hash chain over the full blocks of ``token_ids`` (a trailing partial block is not hashed)."""
    hashes: list[int] = []
    parent = 0
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash((parent, tuple(token_ids[start : start + block_size])))
        hashes.append(parent)
    return hashes


class BlockPool:
    """Fixed pool of KV blocks with reference counts, an LRU free queue and a hash → block map."""

    def __init__(self, num_blocks: int, *, caching: bool) -> None:
        self.num_blocks = num_blocks
        self.caching = caching
        self._refs = [0] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._by_hash: dict[int, int] = {}
        self._hash_of: dict[int, int] = {}

    @property
    def num_free(self) -> int:
        """Blocks not referenced by any request (cached ones included: they can be evicted)."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def usage(self) -> float:
        return self.num_used / self.num_blocks

    def lookup(self, hashes: Sequence[int], max_blocks: int) -> list[int]:
        """Blocks caching the longest prefix of ``hashes`` (at most ``max_blocks``); nothing is taken."""
        if not self.caching:
            return []
        found: list[int] = []
        for h in hashes[:max_blocks]:
            block = self._by_hash.get(h)
            if block is None:
                break
            found.append(block)
        return found

    def count_free_among(self, blocks: Sequence[int]) -> int:
        """How many of ``blocks`` sit in the free queue (taking them shrinks the free count)."""
        return sum(1 for b in blocks if self._refs[b] == 0)

    def touch(self, blocks: Sequence[int]) -> None:
        """Take a reference on cached blocks (prefix hits), pulling unreferenced ones out of the queue."""
        for block in blocks:
            if self._refs[block] == 0:
                del self._free[block]
            self._refs[block] += 1

    def allocate(self, count: int) -> list[int]:
        """Take ``count`` fresh blocks from the LRU head, evicting whatever they cached.

        Callers check capacity first (the engine reserves blocks at admission), so running out is a bug.
        """
        if count > len(self._free):
            raise RuntimeError(f"KV cache exhausted: need {count} blocks, {len(self._free)} free")
        out: list[int] = []
        for _ in range(count):
            block, _ = self._free.popitem(last=False)
            old = self._hash_of.pop(block, None)
            if old is not None and self._by_hash.get(old) == block:
                del self._by_hash[old]
            self._refs[block] = 1
            out.append(block)
        return out

    def register(self, block: int, block_hash: int) -> None:
        """Publish a just-filled prompt block under its hash (first writer wins, as in vLLM)."""
        if self.caching and block_hash not in self._by_hash and block not in self._hash_of:
            self._by_hash[block_hash] = block
            self._hash_of[block] = block_hash

    def free(self, blocks: Sequence[int]) -> None:
        """Drop one reference on each block, tail first so prefixes are evicted last."""
        for block in reversed(blocks):
            self._refs[block] -= 1
            if self._refs[block] == 0:
                self._free[block] = None
