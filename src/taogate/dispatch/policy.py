"""Routing policies: one small synchronous plug point, plain data in, a choice out.

``admission.decide`` filters the fleet down to the instances that may take a request now and hands
them to ``Policy.choose``; a policy only ranks.

* ``RoundRobin``: a cursor over instance names, the A/B baseline (it piles long prompts onto
  whichever instance the cursor happens to hit).
* ``LeastBusy``: the smallest expected latency (``load.estimate``): fixed latency plus queued prefill
  over learned speed, plus the first output tokens at the learned decode pace. Near-ties (within
  ``tie_ratio``: learned speeds carry that much noise) go to the instance with the fewest requests in
  flight, names rotating among equals, so an idle fleet or a burst of cache hits spreads evenly
  instead of feeding the fastest-looking instance.

**Prefix affinity** (``LeastBusy(affinity=True)``). The policy remembers, per prefix key, the few
instances it recently sent the key to (bounded LRU): those hold the prefix. A key never seen is
assumed held by its rendezvous instance over *every* eligible one (so the mapping stays put while an
instance is merely full, and another gateway replica, hashing alike, may have warmed it). Each
candidate is costed with the prefill it needs *there* (``load.expected_prefill``), then:

* the cheapest candidate holds the prefix: take it (``affinity_hit``);
* else the cheapest holder, if within ``affinity_slack`` seconds of the best (``affinity_hit``);
  failing that the best (``affinity_override``), which from then on holds the prefix too;
* the slack is only for keys seen before: a first-seen key may be unique (mixed traffic), and
  following each one's hashed instance would place long prompts at random.

So load decides once a key gets hot: requests sharing one long prefix spread as queues build instead
of piling onto one instance, then each goes to the cheapest instance that has it cached. The lease
still books the whole prompt, not its uncached part (booked that way, a warm instance looked idle
and kept a whole cached burst; ``load`` discounts the booking by the learned uncached share instead),
and a key that lives elsewhere is no longer assumed on its hashed instance (that sent it back cold).
Both measured: benchmarks/dispatch.py.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Protocol

from .affinity import rendezvous
from .load import DEFAULT_LOAD, LoadModel, estimate, expected_prefill
from .types import STRATEGIES, InstanceView, RequestFacts, Send

__all__ = ["STRATEGIES", "LeastBusy", "Policy", "RoundRobin", "make_policy"]


class Policy(Protocol):
    """Pick one of ``candidates`` (eligible and with room), or None to decline.

    ``peers`` names every eligible instance, with room or not (defaults to the candidates); policies
    that map keys to instances range over it so the mapping stays put while an instance is full.
    """

    @property
    def name(self) -> str: ...

    def choose(
        self, req: RequestFacts, candidates: Sequence[InstanceView], peers: Sequence[str] = ()
    ) -> Send | None: ...


def _next_after(names: Sequence[str], last: str | None) -> str:
    """The first name after ``last`` in sorted order, wrapping around: an unbiased rotation."""
    ordered = sorted(names)
    if last is not None:
        for name in ordered:
            if name > last:
                return name
    return ordered[0]


class RoundRobin:
    """Each request to the next instance by name; full or unavailable ones are skipped."""

    def __init__(self) -> None:
        self._last: str | None = None

    @property
    def name(self) -> str:
        return "round_robin"

    def choose(
        self, req: RequestFacts, candidates: Sequence[InstanceView], peers: Sequence[str] = ()
    ) -> Send | None:
        if not candidates:
            return None
        self._last = _next_after([v.name for v in candidates], self._last)
        return Send(self._last, "round_robin")


class LeastBusy:
    """Least expected time to first token, with optional prefix affinity (module docstring)."""

    def __init__(
        self,
        *,
        affinity: bool = False,
        affinity_slack: float = 0.5,
        load: LoadModel = DEFAULT_LOAD,
        tie_ratio: float = 0.05,
        warm_keys: int = 4096,
        warm_per_key: int = 4,
    ) -> None:
        self.affinity = affinity
        self.affinity_slack = max(0.0, affinity_slack)
        self.load = load
        self.tie_ratio = max(0.0, tie_ratio)
        self._last: str | None = None
        self._warm: OrderedDict[int, tuple[str, ...]] = OrderedDict()
        self._warm_keys = max(1, warm_keys)
        self._warm_per_key = max(1, warm_per_key)

    @property
    def name(self) -> str:
        return "least_busy"

    def _remember(self, key: int, instance: str) -> None:
        held = self._warm.pop(key, ())
        self._warm[key] = (instance, *[n for n in held if n != instance])[: self._warm_per_key]
        while len(self._warm) > self._warm_keys:
            self._warm.popitem(last=False)

    def _pick(
        self, candidates: Sequence[InstanceView], costs: Sequence[float], ttfts: Sequence[float]
    ) -> tuple[InstanceView, float]:
        """The cheapest candidate; among near-ties, the one with the fewest requests in flight, and
        among those the names rotate. A near-tie is within ``tie_ratio`` of the best in cost *and* in
        expected TTFT: the decode term is the same size on every similar instance, and judged on the
        sum alone it would make real differences in queued work look like ties."""
        best = min(costs)
        i = costs.index(best)
        widen = 1.0 + self.tie_ratio
        cost_limit, ttft_limit = best * widen, ttfts[i] * widen
        pairs = enumerate(zip(costs, ttfts, strict=True))
        tied = [j for j, (c, t) in pairs if c <= cost_limit and t <= ttft_limit]
        if len(tied) > 1:
            fewest = min(candidates[j].inflight for j in tied)
            names = [candidates[j].name for j in tied if candidates[j].inflight == fewest]
            name = names[0] if len(names) == 1 else _next_after(names, self._last)
            i = next(j for j in tied if candidates[j].name == name)
        self._last = candidates[i].name
        return candidates[i], costs[i]

    def _costs(
        self, req: RequestFacts, candidates: Sequence[InstanceView], work: Sequence[float]
    ) -> tuple[list[float], list[float]]:
        """(expected latency, expected TTFT) of ``req`` on each candidate, given its prefill there."""
        max_tokens, load = req.max_tokens, self.load
        costs: list[float] = []
        ttfts: list[float] = []
        for v, w in zip(candidates, work, strict=True):
            ttft, latency = estimate(v, w, max_tokens, load)
            ttfts.append(ttft)
            costs.append(latency)
        return costs, ttfts

    def choose(
        self, req: RequestFacts, candidates: Sequence[InstanceView], peers: Sequence[str] = ()
    ) -> Send | None:
        if not candidates:
            return None
        key = req.prefix_key if self.affinity else None
        if key is None:
            costs, ttfts = self._costs(req, candidates, [req.prompt_tokens] * len(candidates))
            best, _ = self._pick(candidates, costs, ttfts)
            return Send(best.name, "least_load")

        preferred = rendezvous(key, peers or [v.name for v in candidates])
        # A key seen before is worth bending load for (its next requests hit where it goes); one never
        # seen may be unique (every mixed-traffic prompt starts differently): the preferred instance is
        # still costed with the hit (another gateway may have warmed it) but gets no extra slack.
        seen = self._warm.get(key)
        slack = self.affinity_slack if seen else 0.0
        warm = set(seen) if seen else {preferred}
        hit = max(0, min(req.prefix_tokens, req.prompt_tokens - 1))
        work = [expected_prefill(req.prompt_tokens, hit if v.name in warm else 0) for v in candidates]
        costs, ttfts = self._costs(req, candidates, work)
        best, best_cost = self._pick(candidates, costs, ttfts)
        if best.name in warm:  # the cheapest already holds the prefix: nothing to protect
            self._remember(key, best.name)
            return Send(best.name, "affinity_hit")
        held = [(c, v.name) for v, c in zip(candidates, costs, strict=True) if v.name in warm]
        if held and min(held)[0] <= best_cost + slack:
            name = min(held)[1]
            self._remember(key, name)
            return Send(name, "affinity_hit")
        self._remember(key, best.name)
        return Send(best.name, "affinity_override")


def make_policy(
    strategy: str,
    *,
    affinity: bool = False,
    affinity_slack: float = 0.5,
    load: LoadModel = DEFAULT_LOAD,
) -> Policy:
    """The policy for ``[dispatch] strategy``; an unknown name is an error, never a silent fallback."""
    if strategy == "round_robin":
        return RoundRobin()
    if strategy == "least_busy":
        return LeastBusy(affinity=affinity, affinity_slack=affinity_slack, load=load)
    raise ValueError(f"unknown dispatch strategy {strategy!r}; accepted values: {', '.join(STRATEGIES)}")
