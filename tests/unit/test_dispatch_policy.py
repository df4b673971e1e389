"""Routing policies: round robin and least busy (with prefix affinity)."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

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
    assert make_policy("least_requests").name == "least_requests"
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


def test_without_affinity_prefix_keys_are_ignored() -> None:
    lb = LeastBusy(affinity=False)
    choice = lb.choose(req(key=1), fleet())
    assert choice is not None and choice.reason == "least_load"


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
