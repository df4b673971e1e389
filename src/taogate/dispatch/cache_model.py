"""What one instance's prefix cache probably holds, without seeing it: a bounded LRU of what we sent.

vLLM keeps a block cached after its request ends until its LRU reuses it, and never evicts a running
request's blocks. The model replays that at the gateway by prefix key and token volume: a request
pins its prefix (reusable) and the rest of its prompt and output (never a hit) while it runs,
``finished`` moves them to the fresh end unpinned, and at most ``capacity`` blocks are modelled.
``expected_hit`` counts a key only once this engine has computed it (a first token of a request that
carried it here, or an answer's ``cached_tokens``): a key only *sent* here prices its followers at
their whole prompt once such followers' own ``cached_tokens`` have shown that they miss here
(``follow``); before that they are priced as hits, as vLLM charges them (it caches blocks as it
schedules them, measured on real vLLM). Hits are scaled by ``trust``: how much of what the model
predicted the engine really hit. ``eviction_cost`` is what a miss would push out of a full cache,
and what of it fits nowhere beside the running requests' blocks.
Each rule's reasoning: benchmarks/README.md, "Design notes moved from the code".
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass
from typing import Final

__all__ = ["DEFAULT_BLOCKS", "PrefixCacheModel", "Ticket"]

#: Capacity assumed until the instance says (262,144 tokens in blocks of 16).
DEFAULT_BLOCKS: Final = 16_384
_TRUST_ALPHA: Final = 0.3
_MIN_TRUST: Final = 0.1
_FOLLOW_ALPHA: Final = 0.3
_FOLLOW_ON: Final = 0.5  # their mean hit ratio from which they are priced as hits


@dataclass(init=False, slots=True)
class _Entry:
    blocks: int
    reusable: bool  # a prefix key's blocks (a later request may hit them), or an anonymous remainder
    pinned: int = 0  # our requests using it now
    uses: int = 0  # dispatches that used it
    computed: bool = False  # the engine has computed it (evidence seen since it entered the model)

    def __init__(
        self,
        blocks: int,
        reusable: bool,
        pinned: int = 0,
        uses: int = 0,
        computed: bool = False,
    ) -> None:
        self.blocks = blocks
        self.reusable = reusable
        self.pinned = pinned
        self.uses = uses
        self.computed = computed


@dataclass(init=False, slots=True)
class Ticket:
    """What one dispatch put into the model, to take it out again when the request ends. Never
    changed once built; not ``frozen``, which would set each field through ``object.__setattr__``
    (one is built for every dispatch)."""

    key: int | None
    anon: int
    predicted: int  # hit tokens predicted at dispatch (before trust)
    follow: int = 0  # the hit a follower could get, when its key was in flight here (not computed)

    def __init__(self, key: int | None, anon: int, predicted: int, follow: int = 0) -> None:
        self.key = key
        self.anon = anon
        self.predicted = predicted
        self.follow = follow


class PrefixCacheModel:
    """One instance's modelled prefix cache. Not thread-safe; the gateway's event loop owns it."""

    def __init__(self, capacity_blocks: int = DEFAULT_BLOCKS, block_size: int = 16) -> None:
        self.capacity = max(1, capacity_blocks)
        self.block_size = max(1, block_size)
        self.trust = 1.0
        self.used = 0  # blocks modelled
        self._entries: OrderedDict[int, _Entry] = OrderedDict()  # keys ≥ 0; anonymous ones < 0
        self._anon = itertools.count(1)
        self._predicted = 0  # hit tokens predicted since the last counter observation
        self._exact = False  # answers carry cached_tokens: the counters are not needed
        # EWMA of in-flight followers' hit ratio (``cached_tokens`` / possible hit). It starts at what
        # real vLLM does (it hits them: it caches blocks as it schedules them); the first answer
        # that shows a miss replaces it, so an engine that caches only after prefill is priced so.
        self.follow = 1.0
        self.follow_seen = 0  # in-flight followers whose answers said how much they hit

    def __len__(self) -> int:
        return len(self._entries)

    def configure(self, capacity_blocks: int, block_size: int) -> None:
        """The instance's real cache (from ``vllm:cache_config_info``); a change starts afresh."""
        capacity_blocks, block_size = max(1, capacity_blocks), max(1, block_size)
        if (capacity_blocks, block_size) == (self.capacity, self.block_size):
            return
        if block_size != self.block_size:
            self._entries.clear()
            self.used = 0
        self.capacity, self.block_size = capacity_blocks, block_size
        self._evict()

    # -- reads: what dispatch asks ------------------------------------------------------------
    def max_hit(self, prefix_tokens: int, prompt_tokens: int) -> int:
        """Tokens of a prompt that a cached prefix of ``prefix_tokens`` can save (whole blocks)."""
        bs = self.block_size
        return min(max(0, prefix_tokens), max(0, prompt_tokens - 1)) // bs * bs

    def holds(self, key: int) -> bool:
        """Whether the engine has computed this key's prefix and the model still holds it."""
        entry = self._entries.get(key)
        return entry is not None and entry.reusable and entry.computed

    def sent(self, key: int) -> bool:
        """Whether the model holds this key at all: computed, or only sent and not yet confirmed."""
        entry = self._entries.get(key)
        return entry is not None and entry.reusable

    @property
    def follows(self) -> bool:
        """Whether in-flight followers hit here, as on vLLM, until answers show otherwise (so they
        are priced as hits)."""
        return self.follow >= _FOLLOW_ON

    def in_flight(self, key: int | None) -> bool:
        """Whether one of our requests carries this key here now and the engine has not computed
        it yet (no evidence): a follower sent now is an in-flight follower."""
        entry = self._entries.get(key) if key is not None else None
        return entry is not None and entry.reusable and entry.pinned > 0 and not entry.computed

    def expected_hit(self, key: int | None, prefix_tokens: int, prompt_tokens: int) -> float:
        """Prefill tokens a request with this prefix is expected to skip here."""
        if key is None or not self.holds(key):
            return self._follower_hit(key, prefix_tokens, prompt_tokens)
        return self.max_hit(prefix_tokens, prompt_tokens) * self.trust

    def pinned_hit(self, key: int | None, prefix_tokens: int, prompt_tokens: int) -> float:
        """``expected_hit`` for a key one of our requests is using here right now."""
        entry = self._entries.get(key) if key is not None else None
        if entry is None or not entry.reusable or not entry.pinned:
            return 0.0
        if not entry.computed:
            return self._follower_hit(key, prefix_tokens, prompt_tokens)
        return self.max_hit(prefix_tokens, prompt_tokens) * self.trust

    def inflight(self, key: int) -> int:
        entry = self._entries.get(key)
        return entry.pinned if entry is not None and entry.reusable else 0

    def eviction_cost(self, tokens: int) -> float:
        """Tokens that ``tokens`` more tokens cost the cache: reused prefix tokens they would evict
        (oldest first, times trust), plus those that fit nowhere beside our running requests' blocks
        (vLLM never evicts those: the request waits for running ones to end, or one is preempted
        and prefilled again)."""
        need = self.used + self._blocks(tokens) - self.capacity
        if need <= 0:
            return 0.0
        lost = 0
        for entry in self._entries.values():
            if need <= 0:
                break
            if entry.pinned:
                continue
            need -= entry.blocks
            if entry.reusable and entry.uses > 1:
                lost += entry.blocks
        return lost * self.block_size * self.trust + max(0, need) * self.block_size

    # -- writes: what the gateway tells it ----------------------------------------------------
    def dispatched(
        self, key: int | None, prefix_tokens: int, prompt_tokens: int, output_tokens: int
    ) -> Ticket:
        """A request sent here: its prefix and the rest now occupy the cache, pinned while it runs."""
        if key is None:  # most requests: no prefix, only the rest (one flat pass, the same state)
            tokens = prompt_tokens - prefix_tokens
            if tokens < 0:  # noqa: PLR1730 (max() is a call: this runs per dispatch)
                tokens = 0
            if output_tokens > 0:
                tokens += output_tokens
            rest = -(-tokens // self.block_size)
            anon = -next(self._anon)
            entries = self._entries
            if rest:
                entries[anon] = _Entry(rest, False, 1, 1)
                self.used += rest
            if self.used > self.capacity or len(entries) > self.capacity:
                self._evict()
            return Ticket(None, anon, 0, 0)
        possible = self.max_hit(prefix_tokens, prompt_tokens) if key is not None else 0
        predicted = possible if key is not None and self.holds(key) else 0
        follow = possible if self.in_flight(key) else 0
        self._predicted += predicted
        prefix_blocks = self._blocks(prefix_tokens) if key is not None else 0
        rest = self._blocks(max(0, prompt_tokens - prefix_tokens) + max(0, output_tokens))
        anon = -next(self._anon)
        if rest:
            self._insert(anon, _Entry(rest, False, pinned=1, uses=1))
        if key is not None:
            entry = self._entries.pop(key, None)
            if entry is None or not entry.reusable:
                entry = _Entry(prefix_blocks, True)
                self.used += prefix_blocks
            elif prefix_blocks > entry.blocks:  # a longer estimate of the same prefix
                self.used += prefix_blocks - entry.blocks
                entry.blocks = prefix_blocks
            entry.pinned += 1
            entry.uses += 1
            self._entries[key] = entry
        self._evict()
        return Ticket(key, anon, predicted, follow)

    def computed(self, ticket: Ticket) -> None:
        """The engine computed this request's prefix (its first token came): later ones may hit it."""
        entry = self._entries.get(ticket.key) if ticket.key is not None else None
        if entry is not None and entry.reusable:
            entry.computed = True

    def finished(self, ticket: Ticket) -> None:
        """The request ended: its blocks are freed to the fresh end of the LRU, tail first."""
        entries = self._entries
        if ticket.key is None:  # no prefix: its rest alone (one flat pass, the same state)
            entry = entries.get(ticket.anon)
            if entry is not None:
                pinned = entry.pinned
                entry.pinned = pinned - 1 if pinned > 0 else 0
                entries.move_to_end(ticket.anon)
            if self.used > self.capacity or len(entries) > self.capacity:
                self._evict()
            return
        for name in (ticket.anon, ticket.key):
            if name is None:
                continue
            entry = self._entries.get(name)
            if entry is None:
                continue
            entry.pinned = max(0, entry.pinned - 1)
            self._entries.move_to_end(name)
        self._evict()

    def observe_cached(self, ticket: Ticket, cached_tokens: int) -> None:
        """The engine said how many prompt tokens this request found cached (exact evidence)."""
        self._exact = True
        self.computed(ticket)  # an answer with usage: its prompt was prefilled
        if ticket.follow > 0:  # sent while its prefix was in flight here: did the engine hit it?
            ratio = min(1.0, cached_tokens / (0.95 * ticket.follow))
            first = self.follow_seen == 0
            self.follow = ratio if first else self.follow + _FOLLOW_ALPHA * (ratio - self.follow)
            self.follow_seen += 1
        if ticket.predicted > 0:  # the prediction rests on estimated token counts: a few % off
            self._learn(cached_tokens / (0.95 * ticket.predicted))
        elif cached_tokens > 0 and self.trust < 1.0:  # a hit we did not predict: the cache holds more
            self._learn(1.0)

    def observe_counters(self, hit_tokens: float) -> None:
        """Hit tokens the instance's counter gained since the last scrape (used without exact answers)."""
        predicted, self._predicted = self._predicted, 0
        if self._exact or predicted < self.block_size:
            return
        self._learn(hit_tokens / (0.95 * predicted))

    # -- internals ------------------------------------------------------------------------------
    def _follower_hit(self, key: int | None, prefix_tokens: int, prompt_tokens: int) -> float:
        if not self.follows or not self.in_flight(key):
            return 0.0
        return self.max_hit(prefix_tokens, prompt_tokens) * self.trust * self.follow

    def _learn(self, ratio: float) -> None:
        ratio = min(1.0, max(0.0, ratio))
        self.trust = max(_MIN_TRUST, self.trust + _TRUST_ALPHA * (ratio - self.trust))

    def _blocks(self, tokens: int) -> int:
        return -(-max(0, tokens) // self.block_size)

    def _insert(self, name: int, entry: _Entry) -> None:
        self._entries[name] = entry
        self.used += entry.blocks

    def _evict(self) -> None:
        """Drop least recently used unpinned entries until the model fits the instance's cache
        (pinned ones stay, as vLLM never evicts a running request's blocks) and never holds more
        entries than the cache has blocks. A pinned entry met on the way is in use, hence as recent
        as any (``finished`` moves it there too): it goes to the fresh end, so each call costs what
        it evicts plus the requests in flight, not the model's size."""
        entries, cap = self._entries, self.capacity
        for _ in range(len(entries)):
            if self.used <= cap and len(entries) <= cap:
                return
            name = next(iter(entries))
            entry = entries[name]
            if entry.pinned:
                entries.move_to_end(name)
                continue
            del entries[name]
            self.used -= entry.blocks
