"""How far a plain prompt's prefix runs on each instance: its block chain, and the chains sent there.

A plain prompt's key is its first block (``prefix``), so prompts under one long header (a RAG
template, a few-shot preamble) share it whatever document follows. Its following whole blocks are
hashed each on all before it (``SharedPrefix.chain``). ``PromptChain`` is one request's chain with
the tokens each leading run of it comes to; ``SentChains`` is one instance's memory of the chains
sent to it, least recently sent dropped first once their tokens pass what its cache holds, so each
instance is priced at the blocks its own cache would hit, as vLLM matches blocks, and documents
under one header can be told apart.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Final

from .prefix import BLOCK_CHARS, SharedPrefix
from .tokens import PromptSize, measure_text

__all__ = ["PromptChain", "SentChains"]

_DEFAULT_TOKENS: Final = 262_144  # an instance's cache, until it says
_MAX_HASHES: Final = 65_536  # ~7 MB per instance at most, whatever cache it reports


class PromptChain:
    """One prompt's chain; ``tokens(n)`` is its key's block and the next ``n`` blocks, estimated
    once per run length (a request is priced on several instances)."""

    def __init__(self, shared: SharedPrefix, estimate: Callable[[PromptSize], int]) -> None:
        self.hashes: Sequence[int] = shared.chain
        self._size = shared.size
        self._text = shared.text
        self._estimate = estimate
        self._memo: dict[int, int] = {}

    def tokens(self, blocks: int) -> int:
        blocks = min(max(0, blocks), len(self.hashes))
        got = self._memo.get(blocks)
        if got is None:
            size = self._size
            if blocks:
                size = size + measure_text(self._text[BLOCK_CHARS : (blocks + 1) * BLOCK_CHARS])
            got = self._memo[blocks] = self._estimate(size)
        return got

    def block_tokens(self, prompt_tokens: int) -> int:
        """Tokens one of its blocks comes to, at the prompt's own density (code and CJK text run
        denser than prose): what holding it takes of a cache."""
        return max(1, round(prompt_tokens * BLOCK_CHARS / max(1, len(self._text))))


class SentChains:
    """The chain hashes of the prompts one instance was sent, least recently sent first, their blocks'
    tokens bounded by ``capacity`` (its cache's) and their number by ``_MAX_HASHES``. A chain is added
    tail first, so a prefix is always fresher than what follows it and eviction takes tails first
    (as vLLM frees a request's blocks): a held hash means its prefix is held. Not thread-safe; the
    event loop owns it."""

    def __init__(self, capacity: int = _DEFAULT_TOKENS) -> None:
        self._capacity = max(1, capacity)
        self._held: OrderedDict[int, int] = OrderedDict()  # hash -> its block's tokens
        self._tokens = 0

    def __len__(self) -> int:
        return len(self._held)

    @property
    def tokens(self) -> int:
        return self._tokens

    def resize(self, capacity: int) -> None:
        self._capacity = max(1, capacity)
        self._evict()

    def run(self, chain: Sequence[int]) -> int:
        """How many leading hashes of ``chain`` are held (a binary search: held ones are a prefix)."""
        held = self._held
        lo, hi = 0, len(chain)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if chain[mid - 1] in held:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def add(self, chain: Sequence[int], block_tokens: int) -> None:
        """``chain`` sent here, each of its blocks ``block_tokens`` tokens."""
        held = self._held
        for h in reversed(chain):
            if h in held:
                held.move_to_end(h)
            else:
                held[h] = block_tokens
                self._tokens += block_tokens
        self._evict()

    def _evict(self) -> None:
        held, cap = self._held, self._capacity
        while held and (self._tokens > cap or len(held) > _MAX_HASHES):
            self._tokens -= held.popitem(last=False)[1]
