"""Prefix affinity over cache views: hits only where the prefix was sent, spread only when load
(or, on a tight cache, eviction) says so; least-requests as the baseline."""

from __future__ import annotations

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from taogate.dispatch.cache_model import PrefixCacheModel, Ticket
from taogate.dispatch.load import estimate
from taogate.dispatch.policy import LeastBusy, LeastRequests
from taogate.dispatch.types import InstanceView, RequestFacts

NAMES = ["a", "b", "c", "d"]


class ModelView:
    """The approximate CacheView over one PrefixCacheModel."""

    def __init__(self, model: PrefixCacheModel) -> None:
        self.model = model

    def hit(self, req: RequestFacts) -> float:
        return self.model.expected_hit(req.prefix_key, req.prefix_tokens, req.prompt_tokens)

    def eviction_cost(self, tokens: int) -> float:
        return self.model.eviction_cost(tokens)

    def inflight(self, key: int) -> int:
        return self.model.inflight(key)


class Sim:
    """Instances whose views follow what the policy sent (nothing finishes unless told)."""

    def __init__(self, capacity: int = 16_384, speeds: dict[str, float] | None = None) -> None:
        self.models = {n: PrefixCacheModel(capacity) for n in NAMES}
        self.speeds = speeds or {}
        self.inflight: Counter[str] = Counter()
        self.work: Counter[str] = Counter()
        self.tickets: list[tuple[str, Ticket]] = []

    def views(self) -> list[InstanceView]:
        return [
            InstanceView(
                n,
                inflight=self.inflight[n],
                speed=self.speeds.get(n, 10_000.0),
                cache=ModelView(self.models[n]),
                prefill_work=self.work[n],
                decode_seconds_per_token=0.012,
            )
            for n in NAMES
        ]

    def send(self, lb: LeastBusy, req: RequestFacts) -> str:
        choice = lb.choose(req, self.views())
        assert choice is not None and choice.work is not None
        self.inflight[choice.instance] += 1
        self.work[choice.instance] += choice.work
        ticket = self.models[choice.instance].dispatched(
            req.prefix_key, req.prefix_tokens, req.prompt_tokens, 16
        )
        self.tickets.append((choice.instance, ticket))
        return choice.instance

    def first_tokens(self) -> None:
        """Every request sent so far has its first token: its prefix is computed there."""
        self.work.clear()
        for name, ticket in self.tickets:
            self.models[name].computed(ticket)
        self.tickets.clear()


def req(key: int | None, prompt: int = 4096, prefix: int = 4000) -> RequestFacts:
    return RequestFacts("m", prompt, long=False, prefix_key=key, prefix_tokens=prefix, max_tokens=16)


def test_a_never_seen_key_is_no_hit_anywhere() -> None:
    sim = Sim()
    choice = LeastBusy(affinity=True).choose(req(5), sim.views())
    assert choice is not None and choice.reason == "least_load" and choice.work == 4096


def _followers_seen_missing(sim: Sim) -> None:
    """Every instance's followers in flight were seen to miss: an engine that caches a prompt only
    once its prefill completes (vLLM hits them, and the model assumes so until told otherwise)."""
    for model in sim.models.values():
        model.dispatched(999, 4000, 4096, 16)
        follower = model.dispatched(999, 4000, 4096, 16)
        model.observe_cached(follower, 0)
        model.finished(follower)


def test_a_burst_of_one_prefix_spreads_at_full_cost_until_a_first_token_then_hits() -> None:
    """16 at once sharing a 4,000-token prefix that no engine has computed yet: each is booked at
    its whole prompt (no instance looks almost free), so the burst spreads evenly. Once their first
    tokens came, the next 16 hit wherever the prefix now is, booking only their questions."""
    sim = Sim()
    _followers_seen_missing(sim)
    lb = LeastBusy(affinity=True)
    picks = [sim.send(lb, req(1)) for _ in range(16)]
    assert Counter(picks) == Counter(dict.fromkeys(NAMES, 4))
    assert sum(sim.work.values()) == 16 * 4096  # nothing priced as a hit before the evidence
    sim.first_tokens()
    picks = [sim.send(lb, req(1)) for _ in range(16)]
    assert max(Counter(picks).values()) <= 5
    assert sum(sim.work.values()) <= 16 * 100  # all hits now


def test_where_in_flight_followers_have_hit_a_burst_joins_its_leader_at_the_hit_cost() -> None:
    """On instances whose followers' answers showed hits while their leader was in flight (vLLM),
    a cold burst's followers are priced and booked as those hits: far less than their whole prompt."""
    sim = Sim()
    for model in sim.models.values():
        for key in (101, 102):  # two followers sent behind their leader, each hit all 4,000 tokens
            model.dispatched(key, 4000, 4096, 16)
            follower = model.dispatched(key, 4000, 4096, 16)
            model.observe_cached(follower, 4000)
            model.finished(follower)
    lb = LeastBusy(affinity=True)
    picks = [sim.send(lb, req(1)) for _ in range(16)]
    holders = len(set(picks))
    assert sum(sim.work.values()) <= holders * 4096 + 16 * 100  # one miss per holder, the rest hits


def test_a_burst_never_piles_onto_an_idle_instance_that_has_not_computed_the_prefix() -> None:
    """The herd: three instances busy, one idle that was only *sent* the prefixes. Followers cost
    their whole prompt there, so its queue grows with each and the burst stops going there."""
    sim = Sim()
    _followers_seen_missing(sim)
    lb = LeastBusy(affinity=True)
    for name in ("a", "b", "c"):
        sim.work[name] = 30_000  # busy with 30,000 tokens of prefill each
        sim.inflight[name] = 8
    picks = [sim.send(lb, req(k % 8, 3040, 3000)) for k in range(28)]
    # Its fair share of the work (90,000 + 28 x 3,040 tokens over four) is 14; a follower may join
    # its leader there while that costs at most a quarter more than the best (the hold): not the
    # whole burst (priced as hits, its followers looked free and all 28 went there).
    assert Counter(picks)["d"] <= 14 * 1.25


def test_a_slow_card_gets_the_prefix_only_when_the_fast_ones_are_loaded() -> None:
    sim = Sim(speeds={"d": 4_000.0})
    lb = LeastBusy(affinity=True)
    picks = [sim.send(lb, req(1)) for _ in range(6)]
    assert "d" not in picks


def test_hot_prefixes_partition_over_a_tight_cache() -> None:
    """Eight prefixes, each instance's cache holds about half of them: once each is placed, it is
    not copied around (a miss would evict prefixes that others reuse)."""
    sim = Sim(capacity=4 * 130)  # four 2,000-token prefixes (plus room for the questions)
    lb = LeastBusy(affinity=True)
    holders: dict[int, set[str]] = {k: set() for k in range(8)}
    for round_ in range(12):
        for k in range(8):
            name = sim.send(lb, req(k, 2040, 2000))
            holders[k].add(name)
            sim.inflight[name] -= 1  # answered before the next arrives
            sim.first_tokens()
        del round_
    assert sum(len(h) for h in holders.values()) <= 12  # most prefixes live on one instance


def test_a_holder_keeps_its_prefix_until_it_costs_a_quarter_more_than_the_best() -> None:
    model = PrefixCacheModel()
    model.computed(model.dispatched(7, 4000, 4096, 16))
    holder = ModelView(model)
    empty = ModelView(PrefixCacheModel())
    lb = LeastBusy(affinity=True)

    def pick(queued: int) -> str:
        views = [
            InstanceView("a", speed=10_000.0, cache=holder, prefill_work=queued),
            InstanceView("b", speed=10_000.0, cache=empty),
        ]
        choice = lb.choose(req(7), views)
        assert choice is not None
        return choice.instance

    _, miss = estimate(InstanceView("b", speed=10_000.0), 4096, 16)
    # Queued work that makes the holder cost 1.15x, then 1.4x, what the miss on "b" costs.
    below = round((1.15 * miss - estimate(InstanceView("a", speed=10_000.0), 96, 16)[1]) * 10_000)
    above = round((1.4 * miss - estimate(InstanceView("a", speed=10_000.0), 96, 16)[1]) * 10_000)
    assert pick(below) == "a"
    assert pick(above) == "b"


def test_least_requests_takes_the_fewest_in_flight_and_rotates() -> None:
    lr = LeastRequests()
    views = [InstanceView(n, inflight=i % 2) for i, n in enumerate(NAMES)]
    picks = [lr.choose(req(None), views) for _ in range(4)]
    assert [p.instance for p in picks if p] == ["a", "c", "a", "c"]


@settings(max_examples=80, deadline=None)
@given(
    sent=st.lists(st.tuples(st.sampled_from(NAMES), st.integers(0, 5)), max_size=12),
    key=st.integers(0, 5),
    prompt=st.integers(17, 20_000),  # a one-block prompt hits nowhere (its last token is computed)
    prefix=st.integers(16, 20_000),
    work=st.lists(st.integers(0, 50_000), min_size=4, max_size=4),
)
def test_property_the_pick_is_the_cheapest_given_its_cache(
    *, sent: list[tuple[str, int]], key: int, prompt: int, prefix: int, work: list[int]
) -> None:
    """Each candidate costed with its own hit (and a miss with what it would evict): the pick is the
    cheapest, near-ties aside, unless a holder of the key costs within the hold ratio of it; and it
    hits only where the key was sent. Prefixes span a block at least: a shorter one is a hit
    nowhere, so "holder" here (an instance that would hit) and the policy's (one it was sent to)
    part, and this cost model does not describe the hold rule for it."""
    models = {n: PrefixCacheModel(600) for n in NAMES}
    for name, k in sent:
        models[name].computed(models[name].dispatched(k, 2000, 2100, 16))
    views = [
        InstanceView(n, cache=ModelView(models[n]), prefill_work=w) for n, w in zip(NAMES, work, strict=True)
    ]
    lb = LeastBusy(affinity=True)
    facts = req(key, prompt, min(prefix, prompt))
    choice = lb.choose(facts, views)
    assert choice is not None

    hits = {v.name: v.cache.hit(facts) for v in views if v.cache is not None}
    holders = [v.name for v in views if hits[v.name] > 0]
    share = max(1.0, sum(models[n].inflight(key) for n in holders) / len(holders)) if holders else 1.0

    def cost(v: InstanceView) -> float:
        assert v.cache is not None
        hit = hits[v.name]
        total = estimate(v, max(1.0, prompt - hit), 16)[1]
        if hit <= 0:  # what it evicts, less its share of a hot prefix's new copy
            total += (v.cache.eviction_cost(prompt + 16) - max(hits.values()) * (1 - 1 / share)) / v.speed
        return total

    picked = next(v for v in views if v.name == choice.instance)
    best = min(cost(v) for v in views) * (1 + lb.tie_ratio)
    if choice.reason == "affinity_hit":
        assert models[choice.instance].holds(key)
        assert cost(picked) <= best * (1 + lb.hold_ratio) + 1e-9
    else:  # the cheapest, near-ties aside, and no holder was within the hold ratio of it
        assert cost(picked) <= best + 1e-9
        assert all(cost(v) > cost(picked) * (1 + lb.hold_ratio) - 1e-9 for v in views if v.name in holders)


def test_a_follower_joins_its_leader_at_full_cost_while_the_queues_are_comparable() -> None:
    """Every instance busy alike: a follower of a prefix sent (not yet computed) to ``a`` joins it
    there, booked at its whole prompt (on vLLM it hits the blocks its leader is computing; on an
    engine that caches only computed prompts it does not, and nothing assumed it would)."""
    sim = Sim()
    _followers_seen_missing(sim)
    lb = LeastBusy(affinity=True)
    for name in NAMES:
        sim.work[name] = 20_000
        sim.inflight[name] = 6
    leader = sim.send(lb, req(3, 3040, 3000))
    follower = sim.send(lb, req(3, 3040, 3000))
    assert follower == leader and sim.work[leader] == 20_000 + 2 * 3040


def test_a_wave_of_more_prompts_than_a_tight_cache_holds_puts_whole_prompts_on_the_slow_card() -> None:
    """The real tier's prefix cell: a card 5x faster, caches of 13 blocks of 128 (two ~600-token
    prompts beside their questions), a wave of 8 over 4 prompts. Once the fast card's running
    requests fill its cache, a new prompt's blocks fit nowhere there: it goes to the slow card with
    its follower, rather than thrashing the fast card's cache; the slow card takes no more than
    its share of the wave."""
    names = ["fast", "slow"]
    speeds = {"fast": 5_000.0, "slow": 1_000.0}
    models = {n: PrefixCacheModel(13, 128) for n in names}
    inflight: Counter[str] = Counter()
    work: Counter[str] = Counter()
    lb = LeastBusy(affinity=True)
    placed: dict[int, set[str]] = {}
    for key in (3, 1, 0, 1, 1, 2, 0, 2):
        views = [
            InstanceView(
                n,
                inflight=inflight[n],
                speed=speeds[n],
                base_latency=0.03,
                decode_seconds_per_token=0.005,
                cache=ModelView(models[n]),
                prefill_work=work[n],
            )
            for n in names
        ]
        choice = lb.choose(
            RequestFacts("m", 610, long=False, prefix_key=key, prefix_tokens=595, max_tokens=4), views
        )
        assert choice is not None and choice.work is not None
        inflight[choice.instance] += 1
        work[choice.instance] += choice.work
        models[choice.instance].dispatched(key, 595, 610, 4)
        placed.setdefault(key, set()).add(choice.instance)
    assert 1 <= inflight["slow"] <= 4
    assert all(len(where) == 1 for where in placed.values())  # no prompt copied to both caches
