"""How much of a prompt an earlier one with its prefix key shared, in whole blocks.

A plain prompt's key covers its first block only (``prefix``): prompts sharing a long document, a
file being completed or a few-shot template would otherwise be priced as if only ~256 tokens of
their prefix could hit. Per key, the block chains of its last few prompts are kept; a new prompt
with the key shares the leading blocks its own chain has in common with the closest of them.
Bounded: at most ``keys`` keys (least recently seen dropped first), ``per_key`` chains each.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Final

from .prefix import BLOCK_CHARS, DIGEST, SharedPrefix
from .tokens import PromptSize, measure_text

__all__ = ["PrefixChains", "common_blocks"]

_KEYS: Final = 2048
_PER_KEY: Final = 4


def common_blocks(a: bytes, b: bytes) -> int:
    """How many leading ``DIGEST``-byte hashes two chains share."""
    n = min(len(a), len(b)) // DIGEST
    lo, hi = 0, n  # chains are compared by prefixes: equal up to lo, not beyond hi
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[: mid * DIGEST] == b[: mid * DIGEST]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class PrefixChains:
    """The chains of recent prompts per prefix key. Not thread-safe; the event loop owns it."""

    def __init__(self, keys: int = _KEYS, per_key: int = _PER_KEY) -> None:
        self._keys = max(1, keys)
        self._per_key = max(1, per_key)
        self._chains: OrderedDict[int, list[bytes]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._chains)

    def covered(self, shared: SharedPrefix) -> PromptSize:
        """The size of the part of this prompt an earlier prompt with its key shared (at least the
        key's own block); the prompt's chain is remembered for the next ones."""
        chain = shared.chain
        if not chain:
            return shared.size
        kept = self._chains.get(shared.key)
        if kept is None:
            self._chains[shared.key] = [chain]
            if len(self._chains) > self._keys:
                self._chains.popitem(last=False)
            return shared.size
        self._chains.move_to_end(shared.key)
        best = max(common_blocks(chain, c) for c in kept)
        # Newest first; a chain this one extends (or repeats) is dropped, and one that extends this
        # one already covers it.
        if not any(c.startswith(chain) for c in kept):
            kept[:] = [chain, *(c for c in kept if not chain.startswith(c))][: self._per_key]
        if not best:
            return shared.size
        return shared.size + measure_text(shared.text[BLOCK_CHARS : (best + 1) * BLOCK_CHARS])
