"""Dispatch in virtual time: a simulated fleet with one 2.5× slow instance.

Each instance prefills FCFS at its true speed (a single-server queue: a request's first token comes
when the work queued ahead of it and its own prompt are done), then decodes for a fixed time while it
still holds its slot. The dispatcher sees only what the gateway sees: its own in-flight counts and
outstanding prefill tokens, and speeds it learns from TTFT samples (it starts knowing nothing).
"""

from __future__ import annotations

import heapq
import statistics
from collections import Counter
from dataclasses import dataclass, field

from taogate.dispatch.admission import decide
from taogate.dispatch.policy import LeastBusy, Policy, RoundRobin
from taogate.dispatch.slow import slow_instances
from taogate.dispatch.speed import SpeedEstimator
from taogate.dispatch.types import InstanceView, RequestFacts, Send

TRUE_SPEED = {"a": 1000.0, "b": 1000.0, "c": 1000.0, "slow": 400.0}
DECODE_SECONDS = 0.32  # 16 output tokens at 20 ms


@dataclass
class Inst:
    name: str
    speed: float
    busy_until: float = 0.0
    inflight: int = 0
    decoding: int = 0
    prefill_tokens: int = 0
    cached: set[int] = field(default_factory=set)


@dataclass
class Result:
    counts: Counter[str]
    latencies: list[float]
    makespan: float
    hits: int
    speeds: SpeedEstimator


def simulate(
    policy: Policy,
    *,
    requests: int = 64,
    concurrency: int = 16,
    prompt: int = 4096,
    prefix_key: int | None = None,
    prefix_tokens: int = 0,
    cached_tokens: int = 0,
    cap: int = 32,
) -> Result:
    """The article's check 4.2 in virtual time: ``requests`` prompts, ``concurrency`` clients."""
    fleet = {n: Inst(n, s) for n, s in TRUE_SPEED.items()}
    speeds = SpeedEstimator(10_000.0, weights=dict.fromkeys(fleet, 1.0))
    events: list[tuple[float, int, str, str, float, int, int]] = []
    counts: Counter[str] = Counter()
    latencies: list[float] = []
    seq = 0
    hits = 0
    sent = 0
    now = 0.0

    def dispatch(t: float) -> None:
        nonlocal seq, sent, hits
        facts = RequestFacts("m", prompt, long=False, prefix_key=prefix_key, prefix_tokens=prefix_tokens)
        views = [
            InstanceView(
                i.name,
                inflight=i.inflight,
                decoding=i.decoding,
                cap=cap,
                prefill_tokens=i.prefill_tokens,
                speed=speeds.speed(i.name),
            )
            for i in fleet.values()
        ]
        choice = decide(facts, views, policy)
        assert isinstance(choice, Send)
        inst = fleet[choice.instance]
        hit = prefix_key is not None and prefix_key in inst.cached
        hits += hit
        uncached = prompt - cached_tokens if hit else prompt
        if prefix_key is not None:
            inst.cached.add(prefix_key)
        ahead = inst.prefill_tokens
        first = max(t, inst.busy_until) + uncached / inst.speed
        inst.busy_until = first
        inst.inflight += 1
        inst.prefill_tokens += prompt
        counts[inst.name] += 1
        sent += 1
        seq += 1
        heapq.heappush(events, (first, seq, "first", inst.name, t, ahead, uncached))

    for _ in range(concurrency):
        dispatch(0.0)
    while events:
        now, _, kind, name, start, ahead, uncached = heapq.heappop(events)
        inst = fleet[name]
        if kind == "first":
            inst.prefill_tokens -= prompt
            inst.decoding += 1
            speeds.observe_first_token(
                name, ttft=now - start, ahead_tokens=ahead, uncached_tokens=uncached, prompt_tokens=prompt
            )
            seq += 1
            heapq.heappush(events, (now + DECODE_SECONDS, seq, "done", name, start, ahead, uncached))
        else:
            inst.decoding -= 1
            inst.inflight -= 1
            latencies.append(now - start)
            if sent < requests:
                dispatch(now)
    assert all(i.inflight == 0 and i.prefill_tokens == 0 for i in fleet.values())
    return Result(counts, latencies, now, hits, speeds)


def pooled_bound(requests: int = 64, prompt: int = 4096) -> float:
    return requests * prompt / sum(TRUE_SPEED.values())


def test_round_robin_piles_work_on_the_slow_instance() -> None:
    result = simulate(RoundRobin())
    assert result.counts == dict.fromkeys(TRUE_SPEED, 16)
    assert result.makespan > 1.8 * pooled_bound()


def test_least_busy_gives_the_slow_instance_proportionally_less() -> None:
    rr = simulate(RoundRobin())
    lb = simulate(LeastBusy())
    share = lb.counts["slow"] / 64
    fair = TRUE_SPEED["slow"] / sum(TRUE_SPEED.values())  # 11.8 %
    assert 0.5 * fair <= share <= 1.5 * fair
    assert lb.makespan <= 1.15 * pooled_bound()
    assert lb.makespan < 0.65 * rr.makespan
    mean = statistics.fmean(lb.latencies)
    assert max(lb.latencies) / mean < max(rr.latencies) / statistics.fmean(rr.latencies)


def test_a_long_stream_converges_to_speed_proportional_shares() -> None:
    lb = simulate(LeastBusy(), requests=400, concurrency=24, prompt=8000)
    fast = [lb.counts[n] for n in ("a", "b", "c")]
    assert max(fast) / min(fast) < 1.2
    assert lb.counts["slow"] / statistics.fmean(fast) < 0.6
    assert lb.makespan <= 1.1 * pooled_bound(400, 8000)


def test_shared_prefix_spreads_instead_of_piling_up() -> None:
    """A cache-aware router would send all 64 to one instance: the prompts share their first block."""
    res = simulate(
        LeastBusy(affinity=True, affinity_slack=0.5),
        prefix_key=42,
        prefix_tokens=256,
        cached_tokens=4000,
    )
    assert len(res.counts) == 4
    assert max(res.counts.values()) < 0.5 * 64
    assert res.hits >= 64 - 4  # only each instance's first request misses


def test_lower_cap_moves_requests_away_from_a_deep_queue() -> None:
    """The article's bisection trick: with cap 8 no instance ever holds more than 8."""
    res = simulate(RoundRobin(), concurrency=24, cap=8)
    assert sum(res.counts.values()) == 64  # a full RR cursor skips capped instances


def test_the_detector_flags_the_slow_instance_from_simulated_traffic() -> None:
    speeds = SpeedEstimator(10_000.0, weights=dict.fromkeys(TRUE_SPEED, 1.0))
    for _ in range(12):
        for name, speed in TRUE_SPEED.items():
            speeds.observe_first_token(name, ttft=4096 / speed, ahead_tokens=0, uncached_tokens=4096)
    assert slow_instances(speeds.snapshot()) == {"slow"}
