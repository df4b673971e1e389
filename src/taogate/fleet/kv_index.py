"""The blocks one instance really holds, from its KV-cache events (precise mode).

``BlockStored``/``BlockRemoved`` events keep a reference count per vLLM block hash (the same hash may
be stored twice), bounded at ``capacity`` hashes, oldest first out. A request's hit is the longest
run of its leading block hashes present (``cached_run``), as vLLM's lookup stops at the first miss.

Batches are numbered from 0 per engine start: a restart starts the index over, a stale batch is
ignored, and a gap makes the index untrusted (dispatch falls back on the approximate model) until a
replay fills it or the engine has turned its cache over. Only the first KV group's GPU blocks are
indexed, and a server hashing differently is detected on its first root block and left out (``off``
says why). The sequencing rules in full: benchmarks/README.md, "Design notes moved from the code".
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Final, Literal

from taogate.dispatch.blocks import block_hashes

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
        self.trusted = False  # complete as far as we know: dispatch may use it
        self.matches: bool | None = None  # our hashes are the engine's (None: not checked yet)
        self.off: str | None = None  # why our hashes cannot name its blocks (precise mode off)
        self._seen_since_clear = 0  # blocks stored since the last start-over
        self._was_trusted = False  # before the last gap
        self._last_ts: float | None = None  # the stamp of the last batch applied
        self.gaps = 0  # lost batches seen while trusted (a metric)
        self.restarts = 0  # engine restarts seen (a metric)

    def __len__(self) -> int:
        return len(self._refs)

    @property
    def usable(self) -> bool:
        """A request's own hashes can be looked up here (the index may still be incomplete)."""
        return self.off is None  # set when its hashes are found not ours, or its algorithm is another

    def configure(self, capacity: int, block_size: int, hash_algo: str | None = None) -> None:
        if block_size != self.block_size:
            self.clear()
        self.capacity, self.block_size = max(1, capacity), max(1, block_size)
        if hash_algo is not None and hash_algo != HASH_ALGO:
            self.off = f"it hashes blocks with {hash_algo!r}, not {HASH_ALGO!r}"
        elif self.off is not None and self.matches is not False:
            self.off = None  # it said another algorithm before; now ours
        self._trim()

    def clear(self) -> None:
        self._refs.clear()
        self._seen_since_clear = 0
        self.trusted = False

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
                self._was_trusted = True
            self.trusted = False
            return outcome
        if outcome == "restart":
            self.restarts += 1
            self.clear()
            # A fresh engine's cache is empty: complete from its first batch on; joined later, the
            # batches before this one are unknown, complete only after a full turnover.
            self.trusted = seq == 0
        elif self.next_seq is None:
            # The first batch we see: unless it is the engine's first (we were there from its
            # start), blocks stored before we subscribed are unknown; complete only once it has
            # stored as much as it holds since.
            self.trusted = seq == 0
        self.next_seq = seq + 1
        if ts is not None:
            self._last_ts = ts
        for event in events:
            if isinstance(event, Mapping):
                self._event(event)
        if not self.trusted and self._seen_since_clear >= self.capacity:
            self.trusted = True
        return outcome

    def replayed(self) -> None:
        """A replay filled the gap: the index is as complete as it was before it."""
        self.trusted = self._was_trusted or self._seen_since_clear >= self.capacity

    def start_over(self) -> None:
        """A gap no replay can fill: forget everything, trusted again after a full turnover."""
        self.clear()
        self.next_seq = None
        self._was_trusted = False

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
                    continue
                if count <= 1:
                    del self._refs[h]  # type: ignore[arg-type]
                else:
                    self._refs[h] = count - 1  # type: ignore[index]
        elif kind == "AllBlocksCleared":
            self._refs.clear()

    def _stored(self, event: Mapping[str, Any]) -> None:
        hashes = [h for h in map(_wire, event.get("block_hashes") or ()) if h is not None]
        size = event.get("block_size")
        if isinstance(size, int) and size > 0 and size != self.block_size:
            self._refs.clear()
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
        self._seen_since_clear += len(hashes)
        self._trim()

    def _trim(self) -> None:
        refs = self._refs
        while len(refs) > self.capacity:
            refs.popitem(last=False)
