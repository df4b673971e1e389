"""The engine model: a pure, virtual-time imitation of vLLM's continuous-batching scheduler.

One *step* of the engine (vLLM v1 scheduler, chunked prefill on):

1. Every running request that has finished prefill gets one decode token.
2. The rest of the ``max_num_batched_tokens`` budget goes to prefill chunks: first to running requests
   still in prefill, then to waiting requests admitted in arrival order (FIFO, head-of-line blocking:
   if the head does not fit, nobody behind it is admitted), while fewer than ``max_num_seqs`` run and
   the KV cache can hold the newcomer.
3. The step lasts ``(step_overhead + prefill_tokens / prefill_tokens_per_s
   + decode_tokens / decode_tokens_per_s) * slowdown``. A request's first token is sampled in the step
   that completes its prefill; it finishes when it has ``max_tokens`` tokens (``max_tokens == 0`` is an
   embedding/pooling request that finishes when prefill is done).

KV: admission reserves room for ``prompt + max_tokens`` tokens (minus prefix-cache hits) so an admitted
request never stalls or gets preempted; blocks are then *taken* only as tokens enter the cache, so
``kv_cache_usage`` grows with prefill and decode as in vLLM. (vLLM over-admits and preempts instead;
reservation keeps the model simple and its invariants provable.) With prefix caching on, every block
that a step fills (prompt or generated tokens) is cached when the step is *scheduled*, as vLLM does:
a request admitted later, even in the same step, hits it (``hits_after_prefill``: a prompt's blocks
only once its prefill completes, as some engines do); ``take_events`` returns vLLM's KV events for
what was cached and evicted (``kv_cache``).

Defaults (see ``EmulatorConfig``), chosen to give a healthy card's shape (benchmarks/emulator_figures.py
shows it in real time):

- ``prefill_tokens_per_s = 20_000`` and ``step_overhead = 12 ms``: a lone 4,096-token prompt takes two
  2,048-token chunks, ≈ 2 × (12 + 102) ms ≈ 0.23 s to first token, within the ~0.1–0.3 s a healthy
  GPU takes for it.
- ``decode_tokens_per_s = 3_200``: decode is memory bound, so a batch costs little more than one
  sequence: ≈ 12.3 ms per token alone, ≈ 22 ms per token with 32 sequences decoding.
- ``max_num_seqs = 32``, ``max_num_batched_tokens = 2048``: vLLM's usual online-serving values.
- ``kv_cache_tokens = 262_144`` (16,384 blocks of 16): about what an 8B model leaves for KV on an
  80 GB card; 32 concurrent 4k-token requests fit, so KV pressure appears only when configured
  (``num_gpu_blocks_override``, as vLLM's flag). Blocks of 16 tokens: vLLM's default on a GPU, which
  is what the speeds above model (vLLM on CPU uses 128; ``block_size`` sets it).
- ``slowdown`` multiplies every step: a slow card (throttled, or on a bad link).

The engine never reads a clock: ``schedule()`` returns a ``StepPlan`` with its duration, the caller
waits that long (really or virtually), then ``update(plan)`` applies it and returns the outputs.
Aborts may happen in between; ``update`` skips requests that are gone.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from taogate.dispatch.blocks import block_digests, wire
from taogate.emulator.config import EmulatorConfig
from taogate.emulator.kv_cache import BlockPool, block_stored
from taogate.emulator.tokenizer import Tokenizer

__all__ = [
    "Engine",
    "EngineConfig",
    "EngineRequest",
    "FinishReason",
    "SeqOutput",
    "StepPlan",
]

FinishReason = Literal["stop", "length", "abort"]


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """The scheduler and cost-model knobs: a projection of ``EmulatorConfig``, which holds the
    defaults (build it with ``from_emulator``)."""

    max_num_seqs: int
    max_num_batched_tokens: int
    prefill_tokens_per_s: float
    decode_tokens_per_s: float
    step_overhead: float
    slowdown: float
    block_size: int
    num_kv_blocks: int
    enable_prefix_caching: bool
    kv_events: bool = False
    hits_after_prefill: bool = False  # prompt blocks hittable only once the whole prefill is done

    @classmethod
    def from_emulator(cls, config: EmulatorConfig) -> EngineConfig:
        return cls(
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            prefill_tokens_per_s=config.prefill_tokens_per_s,
            decode_tokens_per_s=config.decode_tokens_per_s,
            step_overhead=config.step_overhead,
            slowdown=config.slowdown,
            block_size=config.block_size,
            num_kv_blocks=config.num_kv_blocks,
            enable_prefix_caching=config.enable_prefix_caching,
            kv_events=config.kv_events_endpoint is not None,
            hits_after_prefill=config.hits_after_prefill,
        )

    def step_duration(self, prefill_tokens: int, decode_tokens: int) -> float:
        base = (
            self.step_overhead
            + prefill_tokens / self.prefill_tokens_per_s
            + decode_tokens / self.decode_tokens_per_s
        )
        return base * self.slowdown


@dataclass(frozen=True, slots=True)
class EngineRequest:
    """What the engine needs to know about a request: identity, prompt token ids, output length."""

    request_id: str
    prompt_token_ids: Sequence[int]
    max_tokens: int


@dataclass(frozen=True, slots=True)
class StepPlan:
    """One scheduled step: who prefills how much, who decodes, and how long it takes."""

    duration: float
    prefill: tuple[tuple[str, int], ...]
    decode: tuple[str, ...]

    @property
    def prefill_tokens(self) -> int:
        return sum(n for _, n in self.prefill)

    @property
    def decode_tokens(self) -> int:
        return len(self.decode)


@dataclass(frozen=True, slots=True)
class SeqOutput:
    """What one request got from a step.

    ``index`` is the 0-based position of the token sampled this step (``None`` when the step sampled
    nothing, e.g. a finished pooling request). ``num_cached_tokens`` is the prefix-cache hit, in tokens.
    """

    request_id: str
    index: int | None
    finish_reason: FinishReason | None
    num_cached_tokens: int


@dataclass(slots=True)
class _Seq:
    request_id: str
    prompt: Sequence[int]
    max_tokens: int
    final_blocks: int
    digests: list[bytes] = field(default_factory=list)  # vLLM's chain over the full blocks so far
    hashes: list[int] = field(default_factory=list)  # their wire values
    blocks: list[int] = field(default_factory=list)
    registered: int = 0  # leading blocks in the prefix cache (hits included)
    num_computed: int = 0  # prompt tokens in the KV cache (cache hits included)
    num_cached: int = 0
    num_output: int = 0

    @property
    def prefilling(self) -> bool:
        return self.num_computed < len(self.prompt)


class Engine:
    """Pure scheduler state machine; see the module docstring for the model."""

    def __init__(self, config: EngineConfig) -> None:
        if config.max_num_seqs > config.max_num_batched_tokens:
            raise ValueError("max_num_batched_tokens must be >= max_num_seqs (one decode token each)")
        self.config = config
        self.pool = BlockPool(
            config.num_kv_blocks, caching=config.enable_prefix_caching, events=config.kv_events
        )
        self._waiting: deque[_Seq] = deque()
        self._running: dict[str, _Seq] = {}  # insertion order = admission order
        # vLLM's waiting gauge is made once per step, after its schedule: requests that arrive
        # during a step are not counted until a schedule leaves them waiting.
        self._waiting_after_step = 0
        self._reserved = 0  # blocks promised to running requests but not yet taken
        # Prefix-cache accounting, in tokens, as vLLM counts it.
        self.prefix_queries = 0
        self.prefix_hits = 0

    # -- observation -----------------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def reported_waiting(self) -> int:
        """What vLLM's ``num_requests_waiting`` says: those the last step's schedule could not admit
        (still waiting), not those that arrived since and join the next step."""
        return min(self._waiting_after_step, len(self._waiting))

    @property
    def kv_usage(self) -> float:
        return self.pool.usage

    def has_work(self) -> bool:
        return bool(self._running or self._waiting)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._running or any(s.request_id == request_id for s in self._waiting)

    # -- input -----------------------------------------------------------------------------------

    def blocks_needed(self, num_prompt_tokens: int, max_tokens: int) -> int:
        return -(-(num_prompt_tokens + max_tokens) // self.config.block_size)

    def add(self, request: EngineRequest) -> None:
        """Queue a request (FIFO). Refuses requests that could never fit the KV cache."""
        if not request.prompt_token_ids:
            raise ValueError("prompt must contain at least one token")
        if request.max_tokens < 0:
            raise ValueError("max_tokens must be >= 0")
        final = self.blocks_needed(len(request.prompt_token_ids), request.max_tokens)
        if final > self.pool.capacity:
            raise ValueError(f"request needs {final} KV blocks but the cache only has {self.pool.capacity}")
        self._waiting.append(
            _Seq(request.request_id, request.prompt_token_ids, request.max_tokens, final_blocks=final)
        )

    def abort(self, request_id: str) -> bool:
        """Drop a waiting or running request and free its KV; ``False`` if it is not here any more."""
        seq = self._running.pop(request_id, None)
        if seq is not None:
            self._release(seq)
            return True
        for seq in self._waiting:
            if seq.request_id == request_id:
                self._waiting.remove(seq)
                return True
        return False

    # -- the step --------------------------------------------------------------------------------

    def schedule(self) -> StepPlan | None:
        """Decide the next step (admitting waiting requests as room allows); ``None`` when idle."""
        budget = self.config.max_num_batched_tokens
        decode: list[str] = []
        prefill: list[tuple[str, int]] = []
        for seq in self._running.values():
            if not seq.prefilling:
                decode.append(seq.request_id)
        budget -= len(decode)
        for rid in decode:
            seq = self._running[rid]
            self._grow(seq, len(seq.prompt) + seq.num_output + 1)
            self._cache(seq, len(seq.prompt) + seq.num_output)
        for seq in self._running.values():
            if budget <= 0:
                break
            if seq.prefilling:
                chunk = min(len(seq.prompt) - seq.num_computed, budget)
                prefill.append((seq.request_id, chunk))
                budget -= chunk
                self._grow(seq, seq.num_computed + chunk)
                self._cache_scheduled(seq, seq.num_computed + chunk)
        while budget > 0 and self._waiting and len(self._running) < self.config.max_num_seqs:
            seq = self._waiting[0]
            if not self._admit(seq):
                break  # FIFO: the head waits for room, and so does everyone behind it
            self._waiting.popleft()
            self._running[seq.request_id] = seq
            chunk = min(len(seq.prompt) - seq.num_computed, budget)
            prefill.append((seq.request_id, chunk))
            budget -= chunk
            self._grow(seq, seq.num_computed + chunk)
            self._cache_scheduled(seq, seq.num_computed + chunk)  # a later admission in this step hits it
        self._waiting_after_step = len(self._waiting)
        if not decode and not prefill:
            return None
        duration = self.config.step_duration(sum(n for _, n in prefill), len(decode))
        return StepPlan(duration=duration, prefill=tuple(prefill), decode=tuple(decode))

    def update(self, plan: StepPlan) -> list[SeqOutput]:
        """Apply a finished step: advance prefill, sample tokens, finish requests."""
        outputs: list[SeqOutput] = []
        for rid, chunk in plan.prefill:
            seq = self._running.get(rid)
            if seq is None:
                continue  # aborted while the step ran
            seq.num_computed += chunk
            if not seq.prefilling:
                if self.config.hits_after_prefill:
                    self._cache(seq, len(seq.prompt))
                outputs.append(self._sample(seq))
        for rid in plan.decode:
            seq = self._running.get(rid)
            if seq is not None:
                outputs.append(self._sample(seq))
        return outputs

    def take_events(self) -> list[dict[str, Any]]:
        """vLLM's KV events for the blocks cached and evicted since the last call, in order."""
        return self.pool.take_events()

    def step(self) -> tuple[StepPlan, list[SeqOutput]] | None:
        """``schedule`` then ``update`` at once: the virtual-time convenience for tests and simulations."""
        plan = self.schedule()
        if plan is None:
            return None
        return plan, self.update(plan)

    # -- internals -------------------------------------------------------------------------------

    def _admit(self, seq: _Seq) -> bool:
        bs = self.config.block_size
        pool = self.pool
        hits: list[int] = []
        if pool.caching:
            if not seq.digests:
                seq.digests = block_digests(seq.prompt, bs)
                seq.hashes = [wire(d) for d in seq.digests]
            # vLLM always recomputes at least the last prompt token (it needs its logits).
            hits = pool.lookup(seq.hashes, (len(seq.prompt) - 1) // bs)
        available = pool.num_free - pool.count_free_among(hits) - self._reserved
        if seq.final_blocks - len(hits) > available:
            return False
        pool.touch(hits)
        seq.blocks = hits
        seq.registered = len(hits)
        seq.num_computed = seq.num_cached = len(hits) * bs
        self._reserved += seq.final_blocks - len(hits)
        if pool.caching:
            self.prefix_queries += len(seq.prompt)
            self.prefix_hits += seq.num_cached
        return True

    def _grow(self, seq: _Seq, tokens: int) -> None:
        need = -(-tokens // self.config.block_size) - len(seq.blocks)
        if need > 0:
            seq.blocks.extend(self.pool.allocate(need))
            self._reserved -= need

    def _tokens(self, seq: _Seq, start: int, end: int) -> list[int]:
        """Token ids ``start:end`` of the request's prompt followed by its generated tokens."""
        prompt = seq.prompt
        n = len(prompt)
        out = list(prompt[start:end]) if start < n else []
        for i in range(max(start, n), end):
            out.append(Tokenizer.generated_id(Tokenizer.generated_word(prompt, i - n)))
        return out

    def _cache_scheduled(self, seq: _Seq, tokens: int) -> None:
        """Prompt blocks scheduled now: cached at once as vLLM does, or at the prefill's end."""
        if not self.config.hits_after_prefill:
            self._cache(seq, tokens)

    def _cache(self, seq: _Seq, tokens: int) -> None:
        """Cache the blocks that ``tokens`` tokens (scheduled now) fill, prompt or generated."""
        pool = self.pool
        if not pool.caching:
            return
        bs = self.config.block_size
        full = min(tokens // bs, len(seq.blocks))
        start = seq.registered
        if full <= start:
            return
        if full > len(seq.digests):  # blocks of generated tokens: extend the chain
            have = len(seq.digests)
            more = block_digests(
                self._tokens(seq, have * bs, full * bs), bs, seq.digests[-1] if seq.digests else None
            )
            seq.digests.extend(more)
            seq.hashes.extend(wire(d) for d in more)
        for i in range(start, full):
            pool.register(seq.blocks[i], seq.hashes[i])
        seq.registered = full
        if pool.record_events:
            parent = seq.hashes[start - 1] if start > 0 else None
            pool.events.append(
                block_stored(seq.hashes[start:full], parent, self._tokens(seq, start * bs, full * bs), bs)
            )

    def _sample(self, seq: _Seq) -> SeqOutput:
        index: int | None = None
        if seq.max_tokens > 0:
            index = seq.num_output
            seq.num_output += 1
        reason: FinishReason | None = None
        if seq.num_output >= seq.max_tokens:
            reason = "length" if seq.max_tokens > 0 else "stop"
            del self._running[seq.request_id]
            self._release(seq)
        return SeqOutput(seq.request_id, index, reason, seq.num_cached)

    def _release(self, seq: _Seq) -> None:
        self._reserved -= seq.final_blocks - len(seq.blocks)
        self.pool.free(seq.blocks)
        seq.blocks = []
