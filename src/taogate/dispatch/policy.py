"""Routing policies: one small synchronous plug point, plain data in, a choice out.

``admission.decide`` filters the fleet down to the instances that may take a request now and hands
them to ``Policy.choose``; a policy only ranks.

* ``RoundRobin``: a cursor over instance names, the A/B baseline.
* ``LeastBusy``: the smallest expected latency (``load.estimate``); near-ties (``tie_ratio``) go to
  the fewest requests in flight, so an idle fleet or a burst of cache hits spreads evenly.
* ``LeastRequests``: the fewest requests in flight (nginx's ``least_conn``), a benchmark baseline.

With prefix affinity, each candidate is costed with the prefill it needs *there* (its cache's
expected hit, plus what a miss would evict on a full cache); a holder of the prefix keeps it until
its cost is markedly worse than the best's (``hold_ratio``), so a hot prefix stays on as few
instances as its load needs. A prefix counts as a hit once that engine has computed it, or while
it is in flight there as long as followers of an in-flight prefix hit (assumed until an answer
shows a miss); an instance where it was only sent otherwise still holds it for the hold rule, at
full price. ``Send.work`` is the prefill booked by the
lease. The reasoning and how ``hold_ratio`` was chosen: benchmarks/README.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from .affinity import rendezvous
from .load import DEFAULT_LOAD, LoadModel, horizon, view_terms
from .types import STRATEGIES, InstanceView, RequestFacts, Send

__all__ = ["STRATEGIES", "LeastBusy", "LeastRequests", "Policy", "RoundRobin", "make_policy"]


class Policy(Protocol):
    """Pick one of ``candidates`` (eligible and with room), or None to decline."""

    @property
    def name(self) -> str: ...

    def choose(self, req: RequestFacts, candidates: Sequence[InstanceView]) -> Send | None: ...


def _next_after(names: Sequence[str], last: str | None) -> str:
    """The first name after ``last`` in sorted order, wrapping around: an unbiased rotation."""
    ordered = sorted(names)
    if last is not None:
        for name in ordered:
            if name > last:
                return name
    return ordered[0]


def _rotate(candidates: Sequence[InstanceView], at: Sequence[int], last: str | None) -> int:
    """The index in ``at`` whose candidate ``_next_after`` names (the first of equal names): the
    name after ``last`` in sorted order, wrapping around, found in one pass without sorting."""
    first = after = -1
    first_name = after_name = ""
    for j in at:
        name = candidates[j].name
        if first < 0 or name < first_name:
            first, first_name = j, name
        if last is not None and name > last and (after < 0 or name < after_name):
            after, after_name = j, name
    return after if after >= 0 else first


def _following(key: int | None, view: InstanceView) -> bool:
    """Whether our requests with this prefix key are in flight on ``view`` (its prefix sent there,
    perhaps not computed yet): a follower is placed with them, priced at its whole prompt."""
    return key is not None and view.cache is not None and view.cache.inflight(key) > 0


class RoundRobin:
    """Each request to the next instance by name; full or unavailable ones are skipped."""

    def __init__(self) -> None:
        self._last: str | None = None

    @property
    def name(self) -> str:
        return "round_robin"

    def choose(self, req: RequestFacts, candidates: Sequence[InstanceView]) -> Send | None:
        if not candidates:
            return None
        self._last = _next_after([v.name for v in candidates], self._last)
        return Send(self._last, "round_robin")


class LeastRequests:
    """The fewest of our requests in flight; names rotate among equals (nginx ``least_conn``)."""

    def __init__(self) -> None:
        self._last: str | None = None

    @property
    def name(self) -> str:
        return "least_requests"

    def choose(self, req: RequestFacts, candidates: Sequence[InstanceView]) -> Send | None:
        if not candidates:
            return None
        fewest = min(v.inflight for v in candidates)
        self._last = _next_after([v.name for v in candidates if v.inflight == fewest], self._last)
        return Send(self._last, "least_requests")


class LeastBusy:
    """Least expected latency, with optional prefix affinity (module docstring)."""

    def __init__(
        self,
        *,
        affinity: bool = False,
        affinity_slack: float = 0.0,
        load: LoadModel = DEFAULT_LOAD,
        tie_ratio: float = 0.05,
        hold_ratio: float = 0.25,
    ) -> None:
        self.affinity = affinity
        self.hold_ratio = max(0.0, hold_ratio)
        self.affinity_slack = max(0.0, affinity_slack)
        self.load = load
        self.tie_ratio = max(0.0, tie_ratio)
        self._last: str | None = None

    @property
    def name(self) -> str:
        return "least_busy"

    def _pick(
        self,
        candidates: Sequence[InstanceView],
        costs: Sequence[float],
        ttfts: Sequence[float],
        key: int | None = None,
    ) -> int:
        """Index of the cheapest candidate; among near-ties, the one with the fewest requests in
        flight, and among those the key's rendezvous choice (no key: the names rotate). A near-tie
        is within ``tie_ratio`` of the best in cost *and* in expected TTFT: the decode term is the
        same size on every similar instance, and judged on the sum alone it would make real
        differences in queued work look like ties."""
        best = min(costs)
        i = costs.index(best)
        widen = 1.0 + self.tie_ratio
        cost_limit, ttft_limit = best * widen, ttfts[i] * widen
        # One pass: the near-ties, and among them the indices of those with the fewest in flight.
        tied = 0
        fewest = -1
        at: list[int] = []
        for j, v in enumerate(candidates):
            if costs[j] <= cost_limit and ttfts[j] <= ttft_limit:
                tied += 1
                n = v.inflight
                if tied == 1 or n < fewest:
                    fewest, at = n, [j]
                elif n == fewest:
                    at.append(j)
        if tied > 1:
            if len(at) == 1:
                i = at[0]
            elif key is not None:
                names = [candidates[j].name for j in at]
                i = at[names.index(rendezvous(key, names) or names[0])]
            else:
                i = _rotate(candidates, at, self._last)
        self._last = candidates[i].name
        return i

    def _costs(
        self, req: RequestFacts, candidates: Sequence[InstanceView], work: Sequence[float]
    ) -> tuple[list[float], list[float]]:
        """(expected latency, expected TTFT) of ``req`` on each candidate, given its prefill there:
        ``load.estimate``, from each view's ``load_terms`` (computed once per view and load model)."""
        load = self.load
        decode = horizon(req.max_tokens, load)
        costs: list[float] = []
        ttfts: list[float] = []
        for v, w in zip(candidates, work, strict=True):
            t = v.load_terms
            if t is None or t[0] is not load:
                t = v.load_terms = view_terms(v, load)
            _, queued, per_token, base, kv, tpot, batch = t
            ttft = base + (queued + (w if w > 0 else 0.0)) * per_token + kv
            ttfts.append(ttft)
            costs.append(ttft + decode * tpot * batch if tpot else ttft)
        return costs, ttfts

    @staticmethod
    def _sharers(key: int | None, candidates: Sequence[InstanceView], hits: Sequence[float]) -> float:
        """Requests expected to share one copy of this prefix: ours with the key in flight per
        instance holding it (at least 1)."""
        if key is None:
            return 1.0
        holders = [v for v, h in zip(candidates, hits, strict=True) if h > 0.0 and v.cache is not None]
        if not holders:
            return 1.0
        inflight = sum(v.cache.inflight(key) for v in holders if v.cache is not None)
        return max(1.0, inflight / len(holders))

    def price(
        self, req: RequestFacts, candidates: Sequence[InstanceView]
    ) -> tuple[list[float], list[float], list[float], list[float]]:
        """(expected hit, prefill work, cost, expected TTFT) of ``req`` on each candidate, as
        ``choose`` ranks them with affinity: a miss also pays what it evicts, less its share of a
        hot prefix's new copy."""
        prompt = req.prompt_tokens
        hits = [v.cache.hit(req) if v.cache is not None else 0.0 for v in candidates]
        work = [max(1.0, prompt - h) for h in hits]
        costs, ttfts = self._costs(req, candidates, work)
        occupied = prompt + (req.max_tokens or self.load.decode_horizon)
        share = self._sharers(req.prefix_key, candidates, hits)
        saved = max(hits)
        for j, v in enumerate(candidates):
            if hits[j] <= 0.0 and v.cache is not None and not _following(req.prefix_key, v):
                speed = max(v.speed, 1e-9)
                lost = v.cache.eviction_cost(occupied)
                # A new copy of a hot prefix serves the requests that will share it there: its
                # prefill is theirs as much as this one's. What it evicts is lost for all of them.
                costs[j] += lost / speed - saved * (1.0 - 1.0 / share) / speed
        return hits, work, costs, ttfts

    def without_affinity(
        self, req: RequestFacts, candidates: Sequence[InstanceView]
    ) -> tuple[list[float], list[float], list[float], list[float]]:
        """``price`` when the request has no prefix to place (or affinity is off): no hits."""
        work = [float(req.prompt_tokens)] * len(candidates)
        return ([0.0] * len(candidates), work, *self._costs(req, candidates, work))

    def uses_cache(self, req: RequestFacts, candidates: Sequence[InstanceView]) -> bool:
        """Whether ``choose`` prices ``req`` by each candidate's cache (affinity, a prefix, a cache)."""
        keyless = req.prefix_key is None and req.blocks is None
        return self.affinity and not keyless and any(v.cache is not None for v in candidates)

    def choose(self, req: RequestFacts, candidates: Sequence[InstanceView]) -> Send | None:
        if not candidates:
            return None
        prompt = req.prompt_tokens
        # Most requests have no prefix to place: that is known before looking at any candidate's cache.
        keyless = req.prefix_key is None and req.blocks is None
        if not self.affinity or keyless or not any(v.cache is not None for v in candidates):
            if len(candidates) == 1:  # nothing to rank: what ``_pick`` returns for one, unpriced
                self._last = candidates[0].name
                return Send(self._last, "least_load", work=prompt)
            costs, ttfts = self._costs(req, candidates, [prompt] * len(candidates))
            best = candidates[self._pick(candidates, costs, ttfts)]
            return Send(best.name, "least_load", work=prompt)

        hits, work, costs, ttfts = self.price(req, candidates)
        i = self._pick(candidates, costs, ttfts, req.prefix_key)
        if hits[i] > 0.0:
            return Send(candidates[i].name, "affinity_hit", work=round(work[i]))
        key = req.prefix_key
        held = [(costs[j], j) for j, v in enumerate(candidates) if hits[j] > 0.0 or _following(key, v)]
        if not held:
            return Send(candidates[i].name, "least_load", work=round(work[i]))
        cost, j = min(held)
        if cost <= costs[i] * (1.0 + self.hold_ratio) + self.affinity_slack:
            return Send(candidates[j].name, "affinity_hit", work=round(work[j]))
        return Send(candidates[i].name, "affinity_override", work=round(work[i]))


def make_policy(
    strategy: str,
    *,
    affinity: bool = False,
    affinity_slack: float = 0.0,
    load: LoadModel = DEFAULT_LOAD,
) -> Policy:
    """The policy for ``[dispatch] strategy``; an unknown name is an error, never a silent fallback."""
    if strategy == "round_robin":
        return RoundRobin()
    if strategy == "least_requests":
        return LeastRequests()
    if strategy == "least_busy":
        return LeastBusy(affinity=affinity, affinity_slack=affinity_slack, load=load)
    raise ValueError(f"unknown dispatch strategy {strategy!r}; accepted values: {', '.join(STRATEGIES)}")
