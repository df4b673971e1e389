"""Plain data the dispatch decisions work on: no I/O, no clocks, no mutation.

The gateway snapshots its live instance state into ``InstanceView`` records and the facts of one
request into ``RequestFacts``; every decision (which instance, wait, refuse) is a pure function of
those, so it is unit- and property-tested without a network.

The records are never changed once built (but for a view's memo of its load terms, a pure function
of its fields); they are not ``frozen`` only because a frozen dataclass sets each field through
``object.__setattr__``, which made building a view far costlier (measured: benchmarks/overhead.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Final, Literal, Protocol, get_args

#: An instance's channel: any request, long inputs only, or short ones only.
Role = Literal["any", "long", "short"]

#: vLLM's ``--scheduling-policy``: only ``priority`` instances act on a request's priority class.
SchedulingPolicy = Literal["fcfs", "priority"]

#: ``[dispatch] strategy``: how the dispatcher ranks the instances that may take a request
#: (``least_requests``, fewest requests in flight as nginx's ``least_conn``, is a baseline).
Strategy = Literal["least_busy", "round_robin", "least_requests"]
STRATEGIES: Final[tuple[str, ...]] = get_args(Strategy)

#: Why an instance was picked; bounded, used as a metric label.
PickReason = Literal[
    "least_load", "affinity_hit", "affinity_override", "round_robin", "least_requests", "overflow"
]

#: Why a request was not sent now; bounded, used as a metric label.
RefuseReason = Literal["no_instance", "queue_full", "queue_timeout", "model_not_found", "shed"]


@dataclass(frozen=True, slots=True)
class EngineStats:
    """What an instance's own /metrics said at its last scrape (covers other gateways' traffic)."""

    waiting: float
    running: float
    kv_usage: float | None = None
    prefix_hit_rate: float | None = None
    age: float = 0.0  # seconds since the scrape


class PromptBlocks(Protocol):
    """A request's own token ids, as vLLM's block hashes (precise mode: a local tokenizer)."""

    def hashes(self, block_size: int) -> Sequence[int]: ...


class PrefixChain(Protocol):
    """A plain prompt's whole blocks after its key's, each hashed on all before it, the tokens its
    key's block and the next ``blocks`` come to, and what one block takes of a cache
    (``dispatch.prefix_chains``)."""

    hashes: Sequence[int]

    def tokens(self, blocks: int) -> int: ...

    def block_tokens(self, prompt_tokens: int) -> int: ...


class CacheView(Protocol):
    """What dispatch may ask of an instance's prefix cache (modelled, or indexed from KV events)."""

    def hit(self, req: RequestFacts) -> float:
        """Prompt tokens ``req`` is expected to find cached there."""
        ...

    def eviction_cost(self, tokens: int) -> float:
        """Reused prefix tokens a miss of ``tokens`` tokens would push out of its cache."""
        ...

    def inflight(self, key: int) -> int:
        """Our requests with this prefix key there now (sent, not finished)."""
        ...


#: What the load estimate computes from a view alone (``load.view_terms``): the load model it was
#: computed for (compared by identity), then ``queued, per_token, base, kv, tpot, batch``.
ViewTerms = tuple[object, float, float, float, float, float, float]


@dataclass(init=False, slots=True)
class InstanceView:
    """One instance as the dispatcher sees it at one moment."""

    name: str
    role: Role = "any"
    models: frozenset[str] = frozenset()  # empty: not learned yet, serves anything
    available: bool = True  # healthy, breaker closed or half-open trial free, not draining
    inflight: int = 0  # our requests sent and not finished (the queue the cap bounds)
    cap: int = 32  # max_queue_per_instance (or the instance's own max_queue)
    prefill_tokens: int = 0  # prompt tokens of our requests that have no first token yet
    decoding: int = 0  # our requests past their first token
    prefilling: int | None = None  # our requests with no first token yet (None: inflight - decoding)
    speed: float = 10_000.0  # learned prefill tokens/s (relative values matter)
    base_latency: float = 0.0  # fixed part of a TTFT here (seconds): what even a tiny prompt waits
    decode_seconds_per_token: float = 0.0  # learned decode pace (0: unknown, no decode term)
    uncached_ratio: float = 1.0  # recent share of its prompt tokens the prefix cache did not cover
    engine: EngineStats | None = None  # None: never scraped, or too stale to trust
    overflow: bool = False  # the optional overflow channel, used only when primaries are full
    cache: CacheView | None = None  # its prefix cache; None: nothing known (no hit expected)
    prefill_work: int | None = None  # expected uncached prefill of ours with no first token yet
    # What the load estimate computes from this view alone (``load.view_terms``), set by the first policy
    # that prices it: a view never changes once built, and a kept one is priced by many dispatches.
    load_terms: ViewTerms | None = field(default=None, init=False, compare=False, repr=False)

    def __init__(  # noqa: PLR0917 (the dataclass's own signature, compiled)
        self,
        name: str,
        role: Role = "any",
        models: frozenset[str] = frozenset(),
        available: bool = True,
        inflight: int = 0,
        cap: int = 32,
        prefill_tokens: int = 0,
        decoding: int = 0,
        prefilling: int | None = None,
        speed: float = 10_000.0,
        base_latency: float = 0.0,
        decode_seconds_per_token: float = 0.0,
        uncached_ratio: float = 1.0,
        engine: EngineStats | None = None,
        overflow: bool = False,
        cache: CacheView | None = None,
        prefill_work: int | None = None,
    ) -> None:
        self.name = name
        self.role = role
        self.models = models
        self.available = available
        self.inflight = inflight
        self.cap = cap
        self.prefill_tokens = prefill_tokens
        self.decoding = decoding
        self.prefilling = prefilling
        self.speed = speed
        self.base_latency = base_latency
        self.decode_seconds_per_token = decode_seconds_per_token
        self.uncached_ratio = uncached_ratio
        self.engine = engine
        self.overflow = overflow
        self.cache = cache
        self.prefill_work = prefill_work
        self.load_terms = None

    @property
    def has_room(self) -> bool:
        return self.inflight < self.cap

    @property
    def own_prefilling(self) -> int:
        """Our requests here with no first token yet: ``prefilling``, else in-flight minus decoding."""
        if self.prefilling is not None:
            return max(0, self.prefilling)
        return max(0, self.inflight - self.decoding)

    def serves(self, model: str | None) -> bool:
        return model is None or not self.models or model in self.models


@dataclass(init=False, slots=True)
class RequestFacts:
    """What dispatch needs to know about one request, read once from its body."""

    model: str | None
    prompt_tokens: int  # estimated (calibrated) prompt size
    long: bool  # prompt_tokens > [prefill] long_input_threshold
    prefix_key: int | None = None  # stable hash of the shared prefix, None when there is none
    prefix_tokens: int = 0  # estimated tokens the prefix key covers: what a cache hit saves, at least
    stream: bool = False
    max_tokens: int | None = None  # the request's output limit, when it gives one
    priority: int = 0  # vLLM's priority class: lower values leave the gateway queue first
    blocks: PromptBlocks | None = None  # its token ids' block hashes (precise mode), else None
    tenant: str = ""  # the client key's name: the gateway queue's fair share between keys
    receipt: bool = False  # the client (or [dispatch] route_receipt) asked why it goes where it goes
    chain: PrefixChain | None = None  # a plain prompt's blocks after its key's: how far it runs where

    def __init__(  # noqa: PLR0917 (the dataclass's own signature, compiled)
        self,
        model: str | None,
        prompt_tokens: int,
        long: bool,
        prefix_key: int | None = None,
        prefix_tokens: int = 0,
        stream: bool = False,
        max_tokens: int | None = None,
        priority: int = 0,
        blocks: PromptBlocks | None = None,
        tenant: str = "",
        receipt: bool = False,
        chain: PrefixChain | None = None,
    ) -> None:
        self.model = model
        self.prompt_tokens = prompt_tokens
        self.long = long
        self.prefix_key = prefix_key
        self.prefix_tokens = prefix_tokens
        self.stream = stream
        self.max_tokens = max_tokens
        self.priority = priority
        self.blocks = blocks
        self.tenant = tenant
        self.receipt = receipt
        self.chain = chain


@dataclass(init=False, slots=True)
class Send:
    instance: str
    reason: PickReason
    channel_fallback: bool = False  # the request's own channel had no healthy instance
    work: int | None = field(default=None, compare=False)  # expected prefill there (less its hit)

    def __init__(
        self,
        instance: str,
        reason: PickReason,
        channel_fallback: bool = False,
        work: int | None = None,
    ) -> None:
        self.instance = instance
        self.reason = reason
        self.channel_fallback = channel_fallback
        self.work = work


@dataclass(frozen=True, slots=True)
class Wait:
    """Every eligible instance is at its cap: wait in the gateway queue for a slot."""


@dataclass(frozen=True, slots=True)
class Refuse:
    reason: RefuseReason


Decision = Send | Wait | Refuse
