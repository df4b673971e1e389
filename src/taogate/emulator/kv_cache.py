"""KV-cache blocks with automatic prefix caching, as vLLM v1's ``BlockPool`` keeps them.

- ``num_blocks`` blocks of ``block_size`` tokens; block 0 is vLLM's null block, never handed out, so
  ``num_blocks - 1`` are usable and ``usage = 1 - free / (num_blocks - 1)``, where cached blocks that
  no request references count as free (``kv_cache_usage_perc`` does not show what the cache holds).
- A full block is named by vLLM's hash chain (``dispatch.blocks``): it matches only if the whole
  prefix before it matches too. A hit takes a reference on the block; its tokens skip prefill.
- Blocks are cached when they are *scheduled* (the engine registers them then), so a request admitted
  later, even in the same step, hits them. Duplicates are kept: two requests that compute the same
  block each register theirs, and evicting one leaves the other a hit.
- Freeing, tail block first: hashed blocks go to the *tail* of the free queue (least recently used
  at the head), unhashed ones to the *head* (reused first). New blocks come from the head, evicting
  whatever hash they had: a prefix outlives its suffixes. Held blocks are never evicted.
- With ``events`` on, every eviction appends vLLM's ``BlockRemoved`` (one per hash) to ``events``;
  the engine appends ``BlockStored`` there as it registers, so the order is the order things happened.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

__all__ = ["BlockPool", "block_removed", "block_stored"]

MEDIUM = "GPU"  # what vLLM's CPU build says too


def block_stored(
    hashes: Sequence[int], parent: int | None, token_ids: Sequence[int], block_size: int
) -> dict[str, Any]:
    """vLLM's ``BlockStored`` as a map, keys in its order (a plain full-attention model, no LoRA)."""
    return {
        "type": "BlockStored",
        "block_hashes": list(hashes),
        "parent_block_hash": parent,
        "token_ids": list(token_ids),
        "block_size": block_size,
        "lora_id": None,
        "medium": MEDIUM,
        "lora_name": None,
        "extra_keys": [None] * len(hashes),
        "group_idx": 0,
        "kv_cache_spec_kind": "full_attention",
    }


def block_removed(block_hash: int) -> dict[str, Any]:
    return {"type": "BlockRemoved", "block_hashes": [block_hash], "medium": MEDIUM, "group_idx": 0}


class BlockPool:
    """Fixed pool of KV blocks with reference counts, an LRU free queue and a hash → blocks map."""

    def __init__(self, num_blocks: int, *, caching: bool, events: bool = False) -> None:
        if num_blocks < 2:
            raise ValueError("the KV cache needs at least 2 blocks (one is the null block)")
        self.num_blocks = num_blocks
        self.caching = caching
        self.record_events = events and caching
        self.events: list[dict[str, Any]] = []
        self._refs = [0] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, num_blocks))
        self._by_hash: dict[int, dict[int, None]] = {}  # hash → the blocks holding it, oldest first
        self._hash_of: dict[int, int] = {}

    @property
    def capacity(self) -> int:
        """Usable blocks: all but the null block."""
        return self.num_blocks - 1

    @property
    def num_free(self) -> int:
        """Blocks not referenced by any request (cached ones included: they can be evicted)."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.capacity - len(self._free)

    @property
    def usage(self) -> float:
        return self.num_used / self.capacity

    @property
    def num_cached(self) -> int:
        """Blocks holding a hash (in use or free)."""
        return len(self._hash_of)

    def lookup(self, hashes: Sequence[int], max_blocks: int) -> list[int]:
        """Blocks caching the longest prefix of ``hashes`` (at most ``max_blocks``); nothing is taken."""
        if not self.caching:
            return []
        found: list[int] = []
        by_hash = self._by_hash
        for h in hashes[:max_blocks]:
            blocks = by_hash.get(h)
            if not blocks:
                break
            found.append(next(iter(blocks)))
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
        """Take ``count`` fresh blocks from the head of the free queue, evicting what they cached.

        Callers check capacity first (the engine reserves blocks at admission), so running out is a bug.
        """
        if count > len(self._free):
            raise RuntimeError(f"KV cache exhausted: need {count} blocks, {len(self._free)} free")
        out: list[int] = []
        for _ in range(count):
            block, _ = self._free.popitem(last=False)
            old = self._hash_of.pop(block, None)
            if old is not None:
                holders = self._by_hash[old]
                del holders[block]
                if not holders:
                    del self._by_hash[old]
                if self.record_events:
                    self.events.append(block_removed(old))
            self._refs[block] = 1
            out.append(block)
        return out

    def register(self, block: int, block_hash: int) -> None:
        """Cache a just-scheduled full block under its hash (duplicates too, as vLLM does)."""
        if self.caching and block not in self._hash_of:
            self._by_hash.setdefault(block_hash, {})[block] = None
            self._hash_of[block] = block_hash

    def free(self, blocks: Sequence[int]) -> None:
        """Drop one reference on each block, tail first: hashed blocks to the tail of the free
        queue (a prefix is then evicted after its suffixes), unhashed ones to the head."""
        free = self._free
        for block in reversed(blocks):
            self._refs[block] -= 1
            if self._refs[block] == 0:
                free[block] = None
                if block not in self._hash_of:
                    free.move_to_end(block, last=False)

    def take_events(self) -> list[dict[str, Any]]:
        out, self.events = self.events, []
        return out
