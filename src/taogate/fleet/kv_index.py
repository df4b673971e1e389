"""The blocks one instance really holds, from its KV-cache events (precise mode).

``BlockStored``/``BlockRemoved`` events keep a reference count per vLLM block hash, bounded at
``capacity`` hashes (oldest first out, as removals may be lost). A request's hit is the longest run
of its leading block hashes present (``cached_run``), as vLLM's lookup stops at the first miss.

Trust (``trust``, its reason and detail: ``fleet.kv_trust``): batches are numbered from 0 per engine
start. Batch 0 or a restart makes the index complete; a missed start or a gap makes it untrusted,
and dispatch uses the approximate model until a replay fills what is missing or the index is proven
complete (the engine cleared its cache, reports nothing cached since it started, or has evicted
every block it may have held unseen). Having stored as many blocks as it holds is no proof. Only
the first KV-cache group's GPU blocks are indexed, and a server hashing differently is left out
(``off`` says why). The rules in full: benchmarks/README.md, "Design notes moved from the code".
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Final, Literal

from taogate.dispatch.blocks import block_hashes
from taogate.fleet.kv_trust import TRUSTED, Reason, Trust

__all__ = ["KvIndex", "Outcome"]

_LOW64: Final = (1 << 64) - 1

Outcome = Literal["ok", "gap", "restart", "stale"]

#: The hash function whose chain ``dispatch.blocks`` reproduces (vLLM's default).
HASH_ALGO: Final = "sha256"


def _wire(value: object) -> int | None:
    """A block hash as published: a uint64, or (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``) 32 bytes."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value & _LOW64
    if isinstance(value, bytes):
        return int.from_bytes(value, "big") & _LOW64
    return None


def _gpu_prefix_cache(event: Mapping[str, Any]) -> bool:
    """The event is about the GPU prefix cache of the first KV-cache group, the one we index."""
    medium = event.get("medium")
    group = event.get("group_idx")
    return (medium is None or medium == "GPU") and (group is None or group == 0)


class KvIndex:
    """One instance's blocks, by vLLM hash, with reference counts. Owned by the event loop."""

    def __init__(self, capacity: int, block_size: int) -> None:
        self.capacity = max(1, capacity)
        self.block_size = max(1, block_size)
        self._refs: OrderedDict[int, int] = OrderedDict()
        self.next_seq: int | None = None  # the sequence number expected next
        self.trusted = False  # complete as far as we know: dispatch may use it (``trust`` says why)
        self.trust = Trust("waiting", "no batch of KV events seen yet")
        self.matches: bool | None = None  # our hashes are the engine's (None: not checked yet)
        self.off: str | None = None  # why our hashes cannot name its blocks (precise mode off)
        self._before_gap: Trust | None = None  # the trust a replay of the gap gives back
        # Whether the engine may hold blocks the index never saw stored (``unknown`` says how many at
        # most); ``epoch`` counts the times that began again, so that the subscriber takes a bound
        # from the engine's counters only from a scrape after it.
        self._tracking = True
        self._bound: int | None = None  # from the engine's counters
        self._unseen_removals = 0
        self.epoch = 0
        self._forgotten = 0  # entries dropped here: their removals are not of unseen blocks
        self.sized = False  # ``capacity`` is the engine's own (from its scrape), not a default
        self._last_ts: float | None = None  # the stamp of the last batch applied
        self.gaps = 0  # lost batches seen while trusted (a metric)
        self.restarts = 0  # engine restarts seen (a metric)

    def __len__(self) -> int:
        return len(self._refs)

    @property
    def usable(self) -> bool:
        """A request's own hashes can be looked up here (the index may still be incomplete)."""
        return self.off is None  # set when its hashes are found not ours, or its algorithm is another

    def state(self) -> tuple[Literal["index", "model"], Reason]:
        """What dispatch for the instance runs on, and why."""
        if self.off is not None:
            return "model", "off"
        return ("index" if self.trusted else "model"), self.trust.reason

    def configure(self, capacity: int, block_size: int, hash_algo: str | None = None) -> None:
        if block_size != self.block_size:
            self._forget()  # hashed in other blocks: no request matches them (its events say more)
        self.capacity, self.block_size = max(1, capacity), max(1, block_size)
        self.sized = True
        if hash_algo is not None and hash_algo != HASH_ALGO:
            self.off = f"it hashes blocks with {hash_algo!r}, not {HASH_ALGO!r}"
        elif self.off is not None and self.matches is not False:
            self.off = None  # it said another algorithm before; now ours
        self._trim()
        self._settle()

    def _forget(self) -> None:
        """Drop the entries; their removals, if they come, are not of blocks never seen stored."""
        self._forgotten += sum(self._refs.values())
        self._refs.clear()

    def clear(self) -> None:
        self._refs.clear()
        self._forgotten = 0
        self.trusted = False

    def _set(self, reason: Reason, detail: str) -> None:
        self.trust = Trust(reason, detail)
        self.trusted = reason in TRUSTED

    def _unknown_from(self, tracking: bool) -> None:
        self._tracking, self._bound, self._unseen_removals = tracking, None, 0
        self.epoch += 1

    @property
    def tracking(self) -> bool:
        """The engine may hold blocks the index never saw stored."""
        return self._tracking

    @property
    def unknown(self) -> int | None:
        """At most how many blocks the engine holds that the index never saw stored (0 while not
        ``tracking``; None: no bound yet, neither its size nor its counters are known)."""
        if not self._tracking:
            return 0
        bounds = [b for b in (self.capacity if self.sized else None, self._bound) if b is not None]
        return max(0, min(bounds) - self._unseen_removals) if bounds else None

    def cached_run(self, hashes: Sequence[int]) -> int:
        """Leading blocks of ``hashes`` the instance holds (vLLM's lookup stops at the first miss)."""
        refs = self._refs
        n = 0
        for h in hashes:
            if h not in refs:
                break
            n += 1
        return n

    # -- batches ---------------------------------------------------------------------------------
    def check(self, seq: int, ts: float | None = None) -> Outcome:
        """What ``seq`` (stamped ``ts``) says about the stream before its batch is applied."""
        expected = self.next_seq
        if expected is None or seq == expected:
            return "ok"
        if seq < expected:
            if seq == 0:
                return "restart"
            last = self._last_ts
            return "restart" if ts is not None and last is not None and ts > last else "stale"
        return "gap"

    def apply(self, seq: int, events: Iterable[object], ts: float | None = None) -> Outcome:
        """Apply one batch (stamped ``ts``, the engine's wall clock) in sequence. After a gap nothing
        is applied and the index is untrusted: the caller replays from ``next_seq`` (then
        ``replayed``) or calls ``start_over`` and applies the batch as the first one."""
        outcome = self.check(seq, ts)
        if outcome == "stale":  # a batch a replay already applied
            return outcome
        if outcome == "gap":
            if self.trusted:
                self.gaps += 1
            if self.trust.reason != "gap":
                self._before_gap = self.trust
            self._set("gap", f"batches {self.next_seq}..{seq - 1} lost")
            return outcome
        if outcome == "restart":
            self.restarts += 1
            self.clear()
            # A fresh engine's cache is empty: complete from its first batch on; joined later, the
            # batches before this one are unknown.
            if seq == 0:
                self._set("restart", "its batches are numbered from 0 again: its cache is empty")
                self._unknown_from(False)
            else:
                self._set("restart_missed", f"it restarted and its first batch seen is seq {seq}")
                self._unknown_from(True)
        elif self.next_seq is None:
            # The first batch we see: unless it is the engine's first (we were there from its
            # start), blocks stored before we subscribed are unknown.
            if seq == 0:
                self._set("from_start", "its first batch (seq 0) was seen")
                self._unknown_from(False)
            elif self.trust.reason == "waiting":
                self._set(
                    "missed_start",
                    f"its first batch seen is seq {seq}: what it cached before is unknown",
                )
        self.next_seq = seq + 1
        if ts is not None:
            self._last_ts = ts
        for event in events:
            if isinstance(event, Mapping):
                self._event(event)
        self._settle()
        return outcome

    def _settle(self) -> None:
        """Trusted once proven complete (see the module's docstring)."""
        if self.trusted:
            return
        if self._tracking and self.unknown == 0 and self.next_seq is not None:
            self._set(
                "old_blocks_gone",
                "every block it may have held before the index began is evicted since",
            )

    def bound_unknown(self, blocks: int) -> None:
        """The engine's counters, read after the index began (``epoch``), bound the blocks it may
        hold unseen: at most what it ever stored and what it has in use. Zero before any batch:
        its cache is empty, and its first batch will be numbered 0."""
        if not self._tracking or self.trusted:
            return
        blocks = max(0, blocks)
        self._bound = blocks if self._bound is None else min(self._bound, blocks)
        if self._tracking and self.unknown == 0 and self.next_seq is None and self.trust.reason == "waiting":
            self.next_seq = 0  # a later first batch is then a gap, not a silent miss
            self._set(
                "quiet",
                "it reports no prompt or generated tokens and no KV blocks in use since it started",
            )
            self._unknown_from(False)
        else:
            self._settle()

    def recovered(self, detail: str) -> None:
        """The engine's replay gave every batch from its start (or it has published none yet)."""
        if self.next_seq is None:
            self.next_seq = 0
        self._set("replayed", detail)
        self._unknown_from(False)

    def note(self, detail: str) -> None:
        """Say more about why the index is what it is (the reason stays)."""
        self.trust = Trust(self.trust.reason, detail)

    def replayed(self) -> None:
        """A replay filled the gap: the index is as complete as it was before it."""
        before, self._before_gap = self._before_gap, None
        if before is not None and before.trusted:
            self._set("replayed", "the engine resent the lost batches")
        else:
            self.trust = before or self.trust
            self.trusted = False
            self._settle()

    def start_over(self, reason: Reason = "gap", detail: str | None = None) -> None:
        """Lost batches no replay can give: forget everything; trusted again once proven complete."""
        self.clear()
        self.next_seq = None
        self._before_gap = None
        self._set(reason, detail or self.trust.detail)
        self._unknown_from(True)

    # -- events ----------------------------------------------------------------------------------
    def _event(self, event: Mapping[str, Any]) -> None:
        kind = event.get("type")
        if kind != "AllBlocksCleared" and not _gpu_prefix_cache(event):
            return
        if kind == "BlockStored":
            self._stored(event)
        elif kind == "BlockRemoved":
            for value in event.get("block_hashes") or ():
                h = _wire(value)
                count = self._refs.get(h) if h is not None else None
                if count is None:
                    self._unseen_removed()
                    continue
                if count <= 1:
                    del self._refs[h]  # type: ignore[arg-type]
                else:
                    self._refs[h] = count - 1  # type: ignore[index]
        elif kind == "AllBlocksCleared":
            self._refs.clear()
            self._forgotten = 0
            if not self.trusted and self.next_seq is not None:
                self._set("cleared", "it cleared its whole prefix cache")
            self._unknown_from(False)

    def _unseen_removed(self) -> None:
        """A block never seen stored is gone: one fewer the engine may hold unseen."""
        if self._forgotten:
            self._forgotten -= 1
        elif self._tracking:
            self._unseen_removals += 1

    def _stored(self, event: Mapping[str, Any]) -> None:
        hashes = [h for h in map(_wire, event.get("block_hashes") or ()) if h is not None]
        size = event.get("block_size")
        if isinstance(size, int) and size > 0 and size != self.block_size:
            self._forget()
            self.block_size = size
        if self.matches is None and event.get("parent_block_hash") is None and hashes:
            tokens = event.get("token_ids")
            if isinstance(tokens, list) and not (event.get("extra_keys") or [None])[0]:
                self.matches = block_hashes(tokens[: self.block_size], self.block_size)[:1] == hashes[:1]
                if not self.matches:
                    self.off = "its first root block's hash is not ours (another hash seed or function)"
        refs = self._refs
        for h in hashes:
            refs[h] = refs.get(h, 0) + 1
            refs.move_to_end(h)
        self._trim()

    def _trim(self) -> None:
        refs = self._refs
        while len(refs) > self.capacity:
            _, count = refs.popitem(last=False)
            self._forgotten += count
