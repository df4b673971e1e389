"""Routing policies: round robin and least busy (with prefix affinity)."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from taogate.dispatch.affinity import rendezvous
from taogate.dispatch.load import expected_ttft
from taogate.dispatch.policy import LeastBusy, RoundRobin, make_policy
from taogate.dispatch.types import EngineStats, InstanceView, RequestFacts, Send

NAMES = ["a", "b", "c", "d"]


def req(tokens: int = 4096, key: int | None = None, prefix: int = 0) -> RequestFacts:
    return RequestFacts(model="m", prompt_tokens=tokens, long=False, prefix_key=key, prefix_tokens=prefix)


def fleet(**work: int) -> list[InstanceView]:
    return [InstanceView(n, inflight=1 if work.get(n) else 0, prefill_tokens=work.get(n, 0)) for n in NAMES]


def test_make_policy_knows_the_strategies_and_refuses_others() -> None:
    assert make_policy("round_robin").name == "round_robin"
    lb = make_policy("least_busy", affinity=True, affinity_slack=2.0)
    assert isinstance(lb, LeastBusy) and lb.affinity and lb.affinity_slack == 2.0
    with pytest.raises(ValueError, match="least_busy, round_robin"):
        make_policy("least-busy")


def test_empty_candidates_decline() -> None:
    assert RoundRobin().choose(req(), []) is None
    assert LeastBusy().choose(req(), []) is None


def test_round_robin_cycles_and_skips_missing() -> None:
    rr = RoundRobin()
    views = fleet()
    picks = [rr.choose(req(), views) for _ in range(8)]
    assert [p.instance for p in picks if p] == NAMES * 2
    assert all(p is not None and p.reason == "round_robin" for p in picks)
    without_b = [v for v in views if v.name != "b"]
    assert [p.instance for p in (rr.choose(req(), without_b) for _ in range(3)) if p] == ["a", "c", "d"]


def test_least_busy_picks_least_work_not_fewest_requests() -> None:
    views = [
        InstanceView("a", inflight=1, prefill_tokens=8000),
        InstanceView("b", inflight=6, prefill_tokens=600),
    ]
    assert LeastBusy().choose(req(), views) == Send("b", "least_load")


def test_least_busy_divides_by_speed() -> None:
    views = [
        InstanceView("fast", speed=1000.0, inflight=1, prefill_tokens=2000),
        InstanceView("slow", speed=400.0),
    ]
    # fast: (2000 + 4096) / 1000 = 6.1 s; slow: 4096 / 400 = 10.2 s.
    assert LeastBusy().choose(req(), views) == Send("fast", "least_load")


def test_idle_fleet_spreads_by_rotation() -> None:
    lb = LeastBusy()
    counts = Counter(p.instance for p in (lb.choose(req(), fleet()) for _ in range(40)) if p)
    assert counts == dict.fromkeys(NAMES, 10)


def test_affinity_follows_the_preferred_instance_while_load_allows() -> None:
    key = 12345
    preferred = rendezvous(key, NAMES)
    assert preferred is not None
    lb = LeastBusy(affinity=True, affinity_slack=0.5)
    assert lb.choose(req(key=key), fleet()) == Send(preferred, "affinity_hit")
    # Busier by 0.3 s (within slack): still followed.
    views = fleet(**{preferred: 3000})
    assert lb.choose(req(key=key), views) == Send(preferred, "affinity_hit")
    # Busier by 2 s: overridden to the least loaded.
    views = fleet(**{preferred: 20_000})
    choice = lb.choose(req(key=key), views)
    assert choice is not None and choice.reason == "affinity_override" and choice.instance != preferred


def test_affinity_counts_the_cache_hit_saving() -> None:
    key = 777
    preferred = rendezvous(key, NAMES)
    assert preferred is not None
    views = fleet(**{preferred: 20_000})  # 2 s of queue at 10k tokens/s
    # A 30,000-token prompt whose 25,000-token prefix is cached there saves 2.5 s.
    lb = LeastBusy(affinity=True, affinity_slack=0.0)
    assert lb.choose(req(30_000, key, 25_000), views) == Send(preferred, "affinity_hit")
    assert lb.choose(req(30_000, key, 0), views) != Send(preferred, "affinity_hit")


def test_affinity_preference_ranges_over_peers_not_just_candidates() -> None:
    key = next(k for k in range(1000) if rendezvous(k, NAMES) == "a")
    lb = LeastBusy(affinity=True)
    # "a" is full (not a candidate): override; the preferred instance was "a", not the best of the rest.
    choice = lb.choose(req(key=key), [v for v in fleet() if v.name != "a"], NAMES)
    assert choice is not None and choice.reason == "affinity_override"
    assert LeastBusy(affinity=True).choose(req(key=key), fleet(), NAMES) == Send("a", "affinity_hit")
    # Where the key went, it is held now (that instance has the prefix; "a" was never sent it).
    assert lb.choose(req(key=key), fleet(), NAMES) == Send(choice.instance, "affinity_hit")


def test_a_key_that_lives_elsewhere_is_not_sent_back_to_its_hashed_instance_cold() -> None:
    key = next(k for k in range(1000) if rendezvous(k, NAMES) == "a")
    lb = LeastBusy(affinity=True, affinity_slack=0.5)
    away = lb.choose(req(4096, key, 2000), fleet(a=30_000), NAMES)  # "a" 3 s behind: goes elsewhere
    assert away is not None and away.instance != "a"
    # "a" is idle again and the holder a little busy: the holder still wins (a hit against a cold prefill).
    views = [
        InstanceView(n, inflight=1, prefill_tokens=1000) if n == away.instance else InstanceView(n)
        for n in NAMES
    ]
    assert lb.choose(req(4096, key, 2000), views, NAMES) == Send(away.instance, "affinity_hit")


def test_without_affinity_prefix_keys_are_ignored() -> None:
    lb = LeastBusy(affinity=False)
    choice = lb.choose(req(key=1), fleet())
    assert choice is not None and choice.reason == "least_load"


def test_shared_prefix_burst_spreads_as_load_builds() -> None:
    """The article's 64 requests share one long prefix: a cache-aware router piles them on one
    instance; ours follows affinity only while the preferred one is not much busier."""
    views = {n: InstanceView(n, speed=1000.0, cap=32) for n in NAMES}
    lb = LeastBusy(affinity=True, affinity_slack=0.5)
    counts: Counter[str] = Counter()
    for _ in range(16):  # 16 in flight at once, none finished
        choice = lb.choose(req(4096, key=99, prefix=256), list(views.values()))
        assert choice is not None
        counts[choice.instance] += 1
        v = views[choice.instance]
        views[v.name] = InstanceView(
            v.name, speed=v.speed, inflight=v.inflight + 1, prefill_tokens=v.prefill_tokens + 4096
        )
    assert max(counts.values()) <= 5 and len(counts) == 4


def _views() -> st.SearchStrategy[list[InstanceView]]:
    one = st.builds(
        InstanceView,
        name=st.sampled_from([*NAMES, "e", "f"]),
        inflight=st.integers(0, 40),
        decoding=st.integers(0, 40),
        prefill_tokens=st.integers(0, 200_000),
        speed=st.floats(100.0, 20_000.0),
        engine=st.none()
        | st.builds(
            EngineStats, waiting=st.floats(0, 50), running=st.floats(0, 50), kv_usage=st.floats(0, 1)
        ),
    )
    return st.lists(one, min_size=1, max_size=6, unique_by=lambda v: v.name)


@settings(max_examples=80, deadline=None)
@given(
    views=_views(),
    prompt=st.integers(1, 50_000),
    key=st.none() | st.integers(0, 2**64 - 1),
    prefix=st.integers(0, 50_000),
    slack=st.floats(0.0, 5.0),
    affinity=st.booleans(),
)
def test_property_least_busy_is_within_slack_of_the_best(
    *, views: list[InstanceView], prompt: int, key: int | None, prefix: int, slack: float, affinity: bool
) -> None:
    lb = LeastBusy(affinity=affinity, affinity_slack=slack)
    facts = req(prompt, key, min(prefix, prompt))
    choice = lb.choose(facts, views)
    assert choice is not None and choice.instance in {v.name for v in views}
    picked = next(v for v in views if v.name == choice.instance)
    best = min(expected_ttft(v, prompt) for v in views)
    hit = choice.reason == "affinity_hit"
    own = expected_ttft(picked, max(1, prompt - facts.prefix_tokens) if hit else prompt)
    allowed = best * (1 + lb.tie_ratio) + (slack if hit else 0.0)
    if not hit and affinity and key is not None:
        allowed = best * (1 + lb.tie_ratio)  # an override takes the best (fresh policy: nothing warm)
    assert own <= allowed + 1e-9


@settings(max_examples=30, deadline=None)
@given(views=_views(), rounds=st.integers(1, 5))
def test_property_round_robin_cycles_evenly(views: list[InstanceView], rounds: int) -> None:
    rr = RoundRobin()
    counts = Counter(c.instance for c in (rr.choose(req(), views) for _ in range(rounds * len(views))) if c)
    assert counts == {v.name: rounds for v in views}


def test_near_ties_go_to_the_instance_holding_fewest_requests() -> None:
    """When the estimates cannot tell instances apart (cache hits, tiny prompts: no queued work),
    the one with fewer requests in flight takes the next, so decode batches stay even instead of
    following the noise between learned speeds."""
    views = [
        InstanceView("a", inflight=3, decoding=3, speed=10_000.0),
        InstanceView("b", inflight=1, decoding=1, speed=9_700.0),  # not the cheapest, but tied
        InstanceView("c", inflight=2, decoding=2, speed=10_000.0),
    ]
    lb = LeastBusy()
    assert [lb.choose(req(40), views) for _ in range(3)] == [Send("b", "least_load")] * 3
    far = [InstanceView("a", speed=10_000.0), InstanceView("b", inflight=0, speed=5_000.0)]
    assert LeastBusy().choose(req(4096), far) == Send("a", "least_load")  # 2x the work is no tie


def test_affinity_takes_the_cheapest_instance_already_holding_the_prefix() -> None:
    """Slack protects a cache hit against a cold instance; when the cheapest candidate holds the
    prefix too (the key spread there under load), there is nothing to protect: take it."""
    key = next(k for k in range(1000) if rendezvous(k, NAMES) == "a")
    lb = LeastBusy(affinity=True, affinity_slack=10.0)
    first = lb.choose(req(4096, key, 4000), [v for v in fleet() if v.name != "a"], NAMES)
    assert first is not None and first.reason == "affinity_override"  # "a" full: the key spreads
    spread = first.instance
    busy_a = fleet(a=8000)  # "a" holds the prefix too, but has 8,000 tokens queued
    assert lb.choose(req(4096, key, 4000), busy_a, NAMES) == Send(spread, "affinity_hit")
    # Against cold instances only, the preferred one is still followed within the slack.
    cold = LeastBusy(affinity=True, affinity_slack=10.0)
    assert cold.choose(req(4096, key, 4000), fleet(), NAMES) == Send("a", "affinity_hit")
    assert cold.choose(req(4096, key, 4000), busy_a, NAMES) == Send("a", "affinity_hit")


def test_a_key_never_seen_gets_no_slack() -> None:
    """Every mixed-traffic prompt starts differently: following each one's hashed instance within the
    slack (0.5 s by default) placed long prompts at random, and the TTFT tail with them. A key seen
    for the first time is costed with its hit on the preferred instance, but bends nothing more."""
    key = next(k for k in range(1000) if rendezvous(k, NAMES) == "a")
    busy_a = fleet(a=8000)  # 0.8 s of queue at 10k tokens/s
    lb = LeastBusy(affinity=True, affinity_slack=10.0)
    first = lb.choose(req(8000, key, 256), busy_a, NAMES)
    assert first is not None and first.instance != "a" and first.reason == "affinity_override"
    # Once seen, the key is worth keeping where it is: its preferred instance gets the slack again.
    again = LeastBusy(affinity=True, affinity_slack=10.0)
    assert again.choose(req(8000, key, 256), fleet(), NAMES) == Send("a", "affinity_hit")
    assert again.choose(req(8000, key, 256), busy_a, NAMES) == Send("a", "affinity_hit")
