"""One instance's prefix cache as dispatch sees it: the modelled LRU, and the KV-event index if any.

``hit(req)``, the prompt tokens a request is expected to find cached there:

* precise (the instance publishes KV events and the request's token ids are known): its longest
  run of leading blocks in the index, times the block size. While the index is not trusted (just
  subscribed, or after lost events) it only under-reports, so the modelled hit is the floor. While
  trusted, the floor is our own running requests whose prefix the engine has computed
  (``pinned_hit``: their blocks cannot be evicted, and their events may be a step late). A prefix
  only sent there, with no first token yet, is a hit while that engine's in-flight followers hit
  (``follows``: as real vLLM does, until an answer there shows a miss), else none until the index
  shows it.
* approximate: the model's ``expected_hit`` (``dispatch.cache_model``), which likewise counts a
  prefix once the engine has computed it (a first token, or ``cached_tokens``), or while it is in
  flight as long as followers there hit (assumed until an answer's ``cached_tokens`` shows a
  miss). A plain prompt's prefix there is its key's block and as many blocks after it as the
  chains sent there share (``chains``), so documents under one header are told apart.
* no cache at all when the instance says its prefix caching is off (``caching``): dispatch then
  works there as with affinity off.

It also takes what the engine says back: its cache's shape from ``vllm:cache_config_info``, the
hit counter between scrapes, and each answer's ``cached_tokens``.
"""

from __future__ import annotations

from taogate.dispatch.cache_model import PrefixCacheModel, Ticket
from taogate.dispatch.prefix_chains import SentChains
from taogate.dispatch.types import RequestFacts
from taogate.fleet.engine import CacheConfig
from taogate.fleet.kv_index import KvIndex

__all__ = ["InstanceCache"]


class InstanceCache:
    """The ``CacheView`` of one instance, and the place its cache evidence arrives."""

    def __init__(self) -> None:
        self.model = PrefixCacheModel()
        self.chains = SentChains()  # the plain prompts' block chains sent here
        self.index: KvIndex | None = None  # set when the instance publishes KV events
        self.config: CacheConfig | None = None
        # False when the instance says its prefix caching is off (then dispatch sees no cache). Kept
        # as a plain attribute, set with the config: it is read for every candidate of every dispatch.
        self.caching = True

    # -- CacheView -------------------------------------------------------------------------------
    def hit(self, req: RequestFacts) -> float:
        model = self.model
        key, prompt = req.prefix_key, req.prompt_tokens
        prefix = req.prefix_tokens if req.chain is None else self._prefix(req)
        index = self.index
        blocks = req.blocks
        if index is None or blocks is None or not index.usable:
            return model.expected_hit(key, prefix, prompt)
        bs = index.block_size
        precise = float(index.cached_run(blocks.hashes(bs)) * bs)
        floor = (
            model.pinned_hit(key, prefix, prompt)
            if index.trusted
            else model.expected_hit(key, prefix, prompt)
        )
        return max(precise, floor)

    def eviction_cost(self, tokens: int) -> float:
        return self.model.eviction_cost(tokens)

    def inflight(self, key: int) -> int:
        return self.model.inflight(key)

    def evidence(self, req: RequestFacts) -> str:
        """What says this instance holds ``req``'s prefix (the route receipt's word for it):
        ``kv_event``, ``computed`` (a first token or an answer here), ``in_flight`` (in flight, not
        computed yet, priced as a hit as on vLLM, until this engine's followers were seen to miss),
        ``sent`` (not computed yet, so no hit is priced), or ``none``."""
        index, blocks, key = self.index, req.blocks, req.prefix_key
        if index is not None and blocks is not None and index.usable:
            indexed = index.cached_run(blocks.hashes(index.block_size))
            if indexed > 0:
                return "kv_event"
        if key is None:
            return "none"
        model = self.model
        if model.holds(key):
            return "computed"
        if model.in_flight(key) and model.follows:
            return "in_flight"
        return "sent" if model.sent(key) else "none"

    # -- evidence ----------------------------------------------------------------------------------
    def configure(self, config: CacheConfig | None) -> None:
        """The instance's cache shape from its latest scrape (None: not exposed, keep the defaults)."""
        if config is None or config == self.config:
            return
        self.config = config
        self.caching = config.prefix_caching
        self.model.configure(config.usable_blocks, config.block_size)
        self.chains.resize(config.usable_blocks * config.block_size)
        if self.index is not None:
            self._configure_index(self.index, config)

    def _configure_index(self, index: KvIndex, config: CacheConfig) -> None:
        # One publisher is one data-parallel rank (the first): its share of the blocks. Another
        # hash algorithm turns the index off (``index.off``; the subscriber logs it).
        index.configure(config.usable_blocks_per_engine, config.block_size, config.hash_algo)

    def enable_index(self) -> KvIndex:
        """Start indexing KV events (the subscriber feeds it)."""
        if self.index is None:
            config = self.config
            index = KvIndex(self.model.capacity, self.model.block_size)
            if config is not None:
                self._configure_index(index, config)
            self.index = index
        return self.index

    def disable_index(self) -> None:
        """The subscription stopped (deliberately or not): dispatch uses the model alone again."""
        self.index = None

    def dispatched(self, req: RequestFacts) -> Ticket:
        out = req.max_tokens if req.max_tokens is not None else 16
        key = req.prefix_key
        if key is None:
            return self.model.dispatched(None, 0, req.prompt_tokens, out)
        chain = req.chain
        if chain is None:
            return self.model.dispatched(key, req.prefix_tokens, req.prompt_tokens, out)
        prefix = self._prefix(req)  # as ``hit`` priced it: the model learns from that prediction
        self.chains.add(chain.hashes, chain.block_tokens(req.prompt_tokens))
        return self.model.dispatched(key, prefix, req.prompt_tokens, out)

    def _prefix(self, req: RequestFacts) -> int:
        """Tokens of ``req``'s prefix this instance was sent: its key's block, and for a plain
        prompt as many of the blocks after it as the chains sent here share."""
        chain, key = req.chain, req.prefix_key
        if chain is None or key is None or not self.model.sent(key):
            return req.prefix_tokens
        return chain.tokens(self.chains.run(chain.hashes))

    def computed(self, ticket: Ticket) -> None:
        """A request sent here has its first token: the engine has computed its prefix."""
        self.model.computed(ticket)

    def finished(self, ticket: Ticket, cached: int | None = None) -> None:
        """The request ended; with ``cached``, the prompt tokens the engine found in its cache."""
        if cached is not None:
            self.model.observe_cached(ticket, cached)
        self.model.finished(ticket)

    def counters(self, hit_tokens: float) -> None:
        self.model.observe_counters(hit_tokens)

    def sizes(self) -> tuple[int, int, int]:
        """(modelled entries, chain hashes, indexed blocks): what this instance's cache state costs
        in memory."""
        return len(self.model), len(self.chains), len(self.index) if self.index is not None else 0
