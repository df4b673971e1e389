"""Learned prefill speed and slow-instance detection."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from taogate.dispatch.slow import SlowRule, evidence_needed, slow_instances, unsure_slow
from taogate.dispatch.speed import SpeedEstimator, SpeedStat


def test_seed_is_weight_times_nominal() -> None:
    est = SpeedEstimator(1000.0, weights={"a": 1.0, "b": 2.0})
    assert est.speed("a") == pytest.approx(1000.0)
    assert est.speed("b") == pytest.approx(2000.0)
    assert est.samples("a") == 0
    assert est.relative("b") == pytest.approx(2000.0 / 1500.0)


def test_sample_is_work_ahead_plus_own_uncached_over_ttft() -> None:
    est = SpeedEstimator(1000.0)
    sample = est.observe_first_token("a", ttft=2.0, ahead_tokens=3000, uncached_tokens=1000)
    assert sample == pytest.approx(2000.0)
    assert est.samples("a") == 1
    assert est.observe_first_token("a", ttft=0.0, ahead_tokens=10, uncached_tokens=10) is None
    assert est.observe_first_token("a", ttft=1.0, ahead_tokens=0, uncached_tokens=0) is None
    assert est.samples("a") == 1


def test_learns_a_slow_instance_within_a_few_requests() -> None:
    rng = random.Random(1)
    est = SpeedEstimator(10_000.0, weights={f"f{i}": 1.0 for i in range(3)} | {"slow": 1.0})
    true = {"f0": 1000.0, "f1": 1000.0, "f2": 1000.0, "slow": 400.0}
    learned_at: int | None = None
    for n in range(1, 11):
        for name, speed in true.items():
            work = 4096.0
            ttft = work / speed * rng.uniform(0.9, 1.1)
            est.observe_first_token(name, ttft=ttft, ahead_tokens=0, uncached_tokens=work)
        if learned_at is None and est.relative("slow") < 0.45:
            learned_at = n
    assert learned_at is not None and learned_at <= 8
    assert est.speed("slow") == pytest.approx(400.0, rel=0.15)
    assert est.relative("slow") == pytest.approx(0.4, rel=0.15)


def test_one_stalled_request_does_not_halve_a_warm_estimate() -> None:
    est = SpeedEstimator(1000.0)
    for _ in range(10):
        est.observe_first_token("a", ttft=1.0, ahead_tokens=0, uncached_tokens=1000)
    est.observe_first_token("a", ttft=100.0, ahead_tokens=0, uncached_tokens=1000)
    assert est.speed("a") > 700.0


def test_tiny_requests_barely_move_the_estimate() -> None:
    est = SpeedEstimator(1000.0)
    for _ in range(10):
        est.observe_first_token("a", ttft=1.0, ahead_tokens=0, uncached_tokens=1000)
    for _ in range(5):  # 10 tokens in 50 ms: mostly fixed overhead, not prefill speed
        est.observe_first_token("a", ttft=0.05, ahead_tokens=0, uncached_tokens=10)
    assert est.speed("a") > 600.0


def test_non_stream_samples_subtract_decode_time() -> None:
    est = SpeedEstimator(1000.0, decode_seconds_per_token=0.02)
    # 1000 prompt tokens at 500 tok/s = 2 s, then 16 tokens at 20 ms: no pace is known yet, and a
    # guessed one would decide the sample, so there is none.
    non_stream = {"duration": 2.0 + 15 * 0.02, "completion_tokens": 16, "ahead_tokens": 0}
    assert est.observe_completion("a", **non_stream, uncached_tokens=1000) is None
    for _ in range(30):  # a stream teaches the pace: 20 ms a token
        est.observe_completion(
            "a", duration=1.0 + 15 * 0.02, completion_tokens=16, ahead_tokens=0, uncached_tokens=1, ttft=1.0
        )
    sample = est.observe_completion("a", **non_stream, uncached_tokens=1000)
    assert sample == pytest.approx(500.0)
    # Decoding dominates: no usable prefill sample.
    assert (
        est.observe_completion("a", duration=10.0, completion_tokens=500, ahead_tokens=0, uncached_tokens=100)
        is None
    )


def test_stream_completion_learns_decode_pace() -> None:
    est = SpeedEstimator(1000.0, decode_seconds_per_token=0.02)
    for _ in range(30):
        assert (
            est.observe_completion(
                "a",
                duration=1.0 + 99 * 0.05,
                completion_tokens=100,
                ahead_tokens=0,
                uncached_tokens=1,
                ttft=1.0,
            )
            is None
        )
    assert est.decode_seconds_per_token("a") == pytest.approx(0.05, rel=0.01)


def test_newcomer_starts_at_the_fleet_scale() -> None:
    est = SpeedEstimator(10_000.0)
    for _ in range(10):
        est.observe_first_token("a", ttft=1.0, ahead_tokens=0, uncached_tokens=1000)
    est.seed("b", weight=2.0)
    assert est.speed("b") == pytest.approx(2 * est.speed("a"))
    est.forget("b")
    assert est.samples("b") == 0 and "b" not in est.snapshot()


def test_rejects_bad_config() -> None:
    with pytest.raises(ValueError):
        SpeedEstimator(0.0)


def test_detector_flags_the_slow_one_with_hysteresis() -> None:
    rule = SlowRule(ratio=0.6, recover_ratio=0.75, min_evidence=8, noise=0.3, confidence=2.0)
    stats = {
        "a": SpeedStat(1000, 20, 20),
        "b": SpeedStat(1000, 20, 20),
        "c": SpeedStat(980, 20, 20),
        "d": SpeedStat(400, 20, 20),
    }
    assert slow_instances(stats, rule=rule) == {"d"}
    # Hovering between the two thresholds: stays as it was.
    hover = {**stats, "d": SpeedStat(700, 20, 20)}
    assert slow_instances(hover, {"d"}, rule) == {"d"}
    assert slow_instances(hover, frozenset(), rule) == frozenset()
    assert slow_instances({**stats, "d": SpeedStat(800, 20, 20)}, {"d"}, rule) == frozenset()
    # Not enough evidence yet, or nobody to compare with.
    assert slow_instances({**stats, "d": SpeedStat(400, 30, 3)}, rule=rule) == frozenset()
    assert slow_instances({"d": SpeedStat(400, 50, 50)}, rule=rule) == frozenset()
    assert slow_instances({"a": SpeedStat(1000, 50, 50), "d": SpeedStat(400, 50, 50)}, rule=rule) == {"d"}


def test_samples_that_stray_far_need_a_wider_gap_before_a_flag() -> None:
    # Equal cards on a busy host: one answer's speed strays by half or double, and their
    # estimates wander to 0.4x of each other. Judged by the assumed 0.3 they would be flagged.
    fast = SpeedStat(25_000, 40, 30.0)
    assert slow_instances({"a": fast, "b": SpeedStat(10_000, 20, 10.0)}) == {"b"}
    assert slow_instances({"a": fast, "b": SpeedStat(10_000, 20, 10.0, spread=0.7)}) == frozenset()
    assert evidence_needed(0.4, SlowRule(), spread=0.7) > SlowRule().memory
    # A card at a tenth of the others' stays far outside even that noise.
    assert slow_instances({"a": fast, "b": SpeedStat(2_500, 20, 10.0, spread=0.7)}) == {"b"}


def test_the_estimator_reports_how_far_its_samples_stray() -> None:
    steady, jumpy = SpeedEstimator(10_000.0), SpeedEstimator(10_000.0)
    for n in range(12):
        steady.observe_first_token("a", ttft=1.0, ahead_tokens=0, uncached_tokens=10_000)
        ttft = 0.5 if n % 2 else 2.0  # twice as fast, then half as fast
        jumpy.observe_first_token("a", ttft=ttft, ahead_tokens=0, uncached_tokens=10_000)
    assert steady.snapshot()["a"].spread < 0.05
    assert 0.5 < jumpy.snapshot()["a"].spread < 1.5
    assert SpeedEstimator().snapshot() == {}  # nothing seen, nothing reported


def test_the_further_below_the_less_evidence_a_flag_needs() -> None:
    # Good dispatch starves a slow card of samples: at a tenth of the others' speed, its warm-up's
    # one full-size sample is enough; just under the line, dozens would be needed, more than the
    # learned speed's EWMA ever rests on, so such a card is within its own estimate's noise.
    rule = SlowRule()
    assert evidence_needed(0.1, rule) == rule.min_evidence == 0.5
    assert 1.0 < evidence_needed(0.4, rule) < 3.0
    assert evidence_needed(0.55, rule) > 30.0
    assert evidence_needed(0.6, rule) == math.inf
    fast = SpeedStat(30_000, 40, 30.0)
    assert slow_instances({"fast": fast, "slow": SpeedStat(3000, 1, 1.0)}) == {"slow"}
    assert slow_instances({"fast": fast, "slow": SpeedStat(3000, 1, 0.3)}) == frozenset()
    assert slow_instances({"fast": fast, "slow": SpeedStat(16_000, 5, 5.0)}) == frozenset()
    assert slow_instances({"fast": fast, "slow": SpeedStat(16_000, 60, 60.0)}) == frozenset()
    assert slow_instances({"fast": fast, "slow": SpeedStat(13_000, 60, 60.0)}) == {"slow"}  # 0.43x
    assert slow_instances({"fast": fast, "slow": SpeedStat(13_000, 2, 2.0)}) == frozenset()


def test_unflagged_cards_whose_estimate_leaves_a_doubt_are_named_with_their_ratio() -> None:
    """What the re-measure round asks after: below the flag line on too little evidence, or below
    the recovery line on samples that disagree; never a card steady on enough samples (just under
    the flag line, where no number of samples flags it, or between the lines), a flagged one, a fast
    one or one unjudged. Each beside three cards at 30,000 tokens/s."""
    fast = SpeedStat(30_000, 40, 30.0)

    def unsure(card: SpeedStat, flagged: frozenset[str] = frozenset()) -> dict[str, float]:
        stats = {"a": fast, "b": fast, "c": fast, "card": card}
        return unsure_slow(stats, slow_instances(stats, flagged))

    few = SpeedStat(6_000, 2, 2.0, spread=1.3)  # 0.2x, its samples far off its estimate
    assert unsure(few) == {"card": pytest.approx(0.2)}
    assert unsure(SpeedStat(21_000, 40, 30.0, spread=0.6)) == {"card": pytest.approx(0.7)}  # seen turning
    assert unsure(SpeedStat(21_000, 40, 30.0, spread=0.1)) == {}  # 0.7x, as its samples say
    assert unsure(SpeedStat(16_500, 2, 2.0, spread=0.1)) == {"card": pytest.approx(0.55)}  # on 2 samples
    assert unsure(SpeedStat(16_500, 40, 30.0, spread=0.1)) == {}  # 0.55x on 30: never flagged, not unsure
    assert unsure(SpeedStat(3_000, 40, 30.0)) == {}  # 0.1x on plenty: flagged instead
    assert unsure(SpeedStat(21_000, 40, 30.0, spread=0.6), frozenset({"card"})) == {}  # kept flagged
    assert unsure(SpeedStat(27_000, 40, 30.0, spread=0.6)) == {}  # 0.9x
    assert unsure(SpeedStat(1_000, 1, 0.1)) == {}  # under min_evidence: not judged


def test_detector_end_to_end_on_a_fleet_with_one_slow_card() -> None:
    rng = random.Random(5)
    true = {"a": 1000.0, "b": 1000.0, "c": 1000.0, "slow": 400.0}
    est = SpeedEstimator(10_000.0, weights=dict.fromkeys(true, 1.0))
    flagged: frozenset[str] = frozenset()
    for _ in range(15):
        for name, speed in true.items():
            work = rng.uniform(2000, 6000)
            est.observe_first_token(
                name, ttft=work / speed * rng.lognormvariate(0, 0.15), ahead_tokens=0, uncached_tokens=work
            )
        flagged = slow_instances(est.snapshot(), flagged)
    assert flagged == {"slow"}


@settings(max_examples=25, deadline=None)
@given(
    n=st.integers(2, 8),
    noise=st.lists(st.floats(0.8, 1.25), min_size=40, max_size=150),
    works=st.lists(st.floats(50, 10_000), min_size=1, max_size=20),
    data=st.data(),
)
def test_property_no_false_flags_on_a_homogeneous_fleet(
    n: int, noise: list[float], works: list[float], data: st.DataObject
) -> None:
    """Same true speed everywhere, adversarial ±25 % sample noise, any order: nothing is ever flagged."""
    names = [f"i{k}" for k in range(n)]
    est = SpeedEstimator(5000.0, weights=dict.fromkeys(names, 1.0))
    flagged: frozenset[str] = frozenset()
    for i, factor in enumerate(noise):
        name = data.draw(st.sampled_from(names))
        work = works[i % len(works)]
        est.observe_first_token(name, ttft=work / 1000.0 * factor, ahead_tokens=0, uncached_tokens=work)
        flagged = slow_instances(est.snapshot(), flagged)
        assert flagged == frozenset()


def test_cache_hits_do_not_pass_for_a_fast_card() -> None:
    """Prompts that mostly hit the prefix cache: the queued whole prompts ahead were barely prefilled."""
    est = SpeedEstimator(1000.0)
    for _ in range(20):  # 4,096-token prompts, 4,000 cached, 3 ahead: real work 4 × 96 at 1,000 tok/s
        est.observe_first_token(
            "hot", ttft=4 * 96 / 1000.0, ahead_tokens=3 * 4096, uncached_tokens=96, prompt_tokens=4096
        )
    assert est.speed("hot") == pytest.approx(1000.0, rel=0.1)
    assert est.uncached_ratio("hot") == pytest.approx(96 / 4096, rel=0.05)


def test_fast_looking_outliers_are_capped_at_twice_the_others() -> None:
    est = SpeedEstimator(1000.0, weights={"a": 1.0, "b": 1.0, "c": 1.0})
    for _ in range(10):
        for name in ("a", "b"):
            est.observe_first_token(name, ttft=1.0, ahead_tokens=0, uncached_tokens=1000)
        est.observe_first_token("c", ttft=0.1, ahead_tokens=0, uncached_tokens=1000)
    assert est.speed("c") == pytest.approx(2000.0, rel=0.01)


def test_unsampled_instances_track_the_fleet_not_their_seed() -> None:
    est = SpeedEstimator(10_000.0, weights={"a": 1.0, "b": 1.0, "new": 0.5})
    est.observe_first_token("a", ttft=4.0, ahead_tokens=0, uncached_tokens=4000)
    est.observe_first_token("b", ttft=4.0, ahead_tokens=0, uncached_tokens=4000)
    fleet = (est.speed("a") + est.speed("b")) / 2
    assert 1000.0 < fleet < 2000.0
    assert est.speed("new") == pytest.approx(0.5 * fleet)
    assert est.speed("unknown") == pytest.approx(fleet)


def test_engine_windows_teach_what_the_gateway_could_not_time() -> None:
    est = SpeedEstimator(1000.0)
    # What vLLM measured: 4 requests of 1,000 computed tokens, 0.25 s of prefill each, 20 ms a token.
    window = {"requests": 4, "prefill_seconds": 0.25, "computed_tokens": 1000.0}
    sample = est.observe_engine("a", **window, prompt_tokens=2000.0, decode_seconds_per_token=0.02)
    assert sample == pytest.approx(4000.0)
    assert est.speed("a") > 2500.0 and est.samples("a") == 4
    assert est.uncached_ratio("a") < 0.9  # half of the prompt tokens were cache hits
    assert est.decode_seconds_per_token("a") == pytest.approx(0.02, rel=0.2)
    # A non-stream answer's prefill is in the engine's window: no decode pace to guess at.
    assert (
        est.observe_completion("a", duration=5.0, completion_tokens=9, ahead_tokens=0, uncached_tokens=1)
        is None
    )
    # A stream's TTFT still teaches at once, unless the engine had a queue (a wait for a batch slot
    # that no booked work explains); without cache details the engine's computed share stands in.
    assert est.observe_first_token("a", ttft=9.0, ahead_tokens=0, uncached_tokens=1000, queued=True) is None
    assert est.observe_first_token(
        "a", ttft=0.5, ahead_tokens=0, uncached_tokens=None, prompt_tokens=2000
    ) == (pytest.approx(2000 * est.uncached_ratio("a") / 0.5))
    # The next window holds that request too: only the rest of it teaches.
    before = est.speed("a")
    assert est.observe_engine("a", requests=1, prefill_seconds=5.0, computed_tokens=1000.0) is None
    assert est.speed("a") == before
    # A window of small prompts teaches nothing: a step's own overhead, not the speed, and the engine's
    # clock holds none of the gateway's fixed latency.
    base = est.base_latency("a")
    assert est.observe_engine("a", requests=8, prefill_seconds=0.01, computed_tokens=20.0) is None
    assert est.speed("a") == before and est.base_latency("a") == base
    assert est.observe_engine("a", requests=0, prefill_seconds=1.0, computed_tokens=1.0) is None


def test_engine_windows_are_not_discounted_by_the_gateways_fixed_latency() -> None:
    est = SpeedEstimator(1000.0, small_tokens=256)
    for _ in range(5):  # short streams: 0.2 s to a first token is the path to the card, not prefill
        est.observe_first_token("a", ttft=0.2, ahead_tokens=0, uncached_tokens=10)
    assert est.base_latency("a") == pytest.approx(0.2, rel=0.05)
    # vLLM timed 1,000 tokens' prefill at 0.25 s on its own clock: 4,000 tokens/s, not 1,000 / 0.05.
    # The window holds the five streams too (already learned from) and two more requests.
    sample = est.observe_engine("a", requests=7, prefill_seconds=0.25, computed_tokens=1000.0)
    assert sample == pytest.approx(4000.0)


def _engine_instance(est: SpeedEstimator, name: str) -> None:
    """An instance that reports its phases and was learned at 10k tokens/s, fixed latency 20 ms."""
    for _ in range(5):
        est.observe_first_token(name, ttft=0.02, ahead_tokens=0, uncached_tokens=10)
        est.observe_engine(name, requests=4, prefill_seconds=0.1, computed_tokens=1000.0)


def test_a_first_token_held_up_outside_the_engine_teaches_nothing() -> None:
    est = SpeedEstimator(10_000.0, small_tokens=128)
    _engine_instance(est, "a")
    before = est.speed("a")
    # Two answers took 0.5 s to a first token, while the engine queued and prefilled them in 0.1 s:
    # the other 0.4 s went elsewhere (its HTTP server, a stalled host), not to a slow prefill.
    for _ in range(2):
        assert est.observe_first_token("a", ttft=0.5, ahead_tokens=0, uncached_tokens=1000, hold=True) is None
    assert est.speed("a") == before  # held: dispatch goes on with what it knew
    est.observe_first_token("a", ttft=0.02, ahead_tokens=0, uncached_tokens=10, hold=True)
    assert est.speed("a") == before  # a small one teaches the fixed latency, and releases nothing
    sample = est.observe_engine(
        "a", requests=2, prefill_seconds=0.08, queue_seconds=0.02, computed_tokens=1000.0
    )
    assert sample == pytest.approx(12_500.0)  # the window taught its two requests itself
    assert est.speed("a") >= before


def test_a_held_first_token_the_engine_vouches_for_teaches_as_it_came() -> None:
    held, direct = SpeedEstimator(10_000.0), SpeedEstimator(10_000.0)
    for est in (held, direct):
        _engine_instance(est, "a")
    # A slow prefill, in the engine too: the TTFT was the engine's time and the fixed latency.
    held.observe_first_token("a", ttft=0.5, ahead_tokens=0, uncached_tokens=1000, hold=True)
    held.observe_engine("a", requests=1, prefill_seconds=0.45, computed_tokens=1000.0)
    direct.observe_first_token("a", ttft=0.5, ahead_tokens=0, uncached_tokens=1000)
    direct.observe_engine("a", requests=1, prefill_seconds=0.45, computed_tokens=1000.0)
    assert held.speed("a") == pytest.approx(direct.speed("a"))
    assert held.speed("a") < 9_000.0


def test_held_first_tokens_teach_when_no_window_comes() -> None:
    est = SpeedEstimator(10_000.0)
    _engine_instance(est, "a")
    before = est.speed("a")
    est.observe_first_token("a", ttft=0.5, ahead_tokens=0, uncached_tokens=1000, hold=True)
    est.settle("a")  # a scrape that saw nothing finish
    assert est.speed("a") < before
    # Without ``hold`` (the instance's engine stats went stale), a sample teaches at once.
    again = est.speed("a")
    assert est.observe_first_token("a", ttft=0.5, ahead_tokens=0, uncached_tokens=1000) is not None
    assert est.speed("a") < again


def test_a_small_first_token_teaches_the_fixed_latency_at_once_even_when_held() -> None:
    # A card across a slow link: its 0.2 s path is outside the engine by nature, and the small
    # prompts that teach it must not wait for, or be judged by, the engine's windows.
    est = SpeedEstimator(10_000.0, small_tokens=128)
    _engine_instance(est, "far")
    for _ in range(5):
        assert est.observe_first_token("far", ttft=0.2, ahead_tokens=0, uncached_tokens=10, hold=True) is None
    assert est.base_latency("far") > 0.1  # from 0.02, on its way to 0.2


def test_engine_learned_speeds_are_not_capped() -> None:
    # Computed tokens exclude cache hits: a card ten times faster is not held at fast_cap (2x).
    est = SpeedEstimator(1000.0, fast_cap=2.0)
    for _ in range(5):
        est.observe_engine("fast", requests=4, prefill_seconds=0.1, computed_tokens=1000.0)
        est.observe_engine("slow", requests=1, prefill_seconds=1.0, computed_tokens=1000.0)
    assert est.speed("fast") / est.speed("slow") > 8.0


def test_rebuild_every_defers_learned_speeds_but_not_fleet_changes() -> None:
    now = [0.0]
    est = SpeedEstimator(rebuild_every=0.005, clock=lambda: now[0])
    est.seed("a")
    est.seed("b")
    before = est.params("a")
    est.observe_first_token("a", ttft=0.1, ahead_tokens=0, uncached_tokens=4000)  # 40k tok/s: fast
    assert est.params("a") == before  # dispatch's read was rebuilt moments ago: the sample waits
    now[0] += 0.005
    assert est.params("a") != before
    est.observe_first_token("a", ttft=0.1, ahead_tokens=0, uncached_tokens=4000)
    assert est.speed("a") == est.params("a")[0] != before[0]  # other reads are exact, and rebuild
    est.observe_first_token("a", ttft=0.1, ahead_tokens=0, uncached_tokens=4000)
    est.seed("c")  # a new instance is visible at once, with whatever was learned meanwhile
    assert est.speed("c") > 0 and est.params("c")[0] == est.speed("c")
    exact = SpeedEstimator()  # the default: every read sees every sample
    exact.observe_first_token("a", ttft=0.1, ahead_tokens=0, uncached_tokens=4000)
    assert exact.speed("a") != SpeedEstimator().speed("a")


def test_decode_pace_before_any_sample_follows_the_fixed_latency() -> None:
    """Before a card has streamed a completion, its decode pace is the fleet's, scaled by how much
    slower its fixed latency is (every engine step is slower on a slow card): otherwise a 2.5x slow
    card looks as quick as the others for every cache hit and short prompt until its first answer."""
    est = SpeedEstimator(10_000.0, decode_seconds_per_token=0.02)
    for _ in range(3):
        for name, base in (("a", 0.02), ("b", 0.02), ("c", 0.05)):
            est.observe_first_token(name, ttft=base, ahead_tokens=0, uncached_tokens=10)
    assert est.decode_seconds_per_token("a") == pytest.approx(0.02)
    assert est.decode_seconds_per_token("c") == pytest.approx(0.02 * 2.5)
    assert est.decode_seconds_per_token("unknown") == pytest.approx(0.02)
    est.observe_completion(
        "c", duration=0.05 + 9 * 0.03, completion_tokens=10, ahead_tokens=0, uncached_tokens=10, ttft=0.05
    )
    # Its own now, moved from the pace it was priced at, not from the configured prior.
    assert est.decode_seconds_per_token("c") == pytest.approx(0.05 + 0.2 * (0.03 - 0.05))
    # The warm-up's one prefill is enough: a card that prefilled at 40% of the others' speed is
    # costed at 2.5x their decode pace until it streams a completion itself.
    warmed = SpeedEstimator(10_000.0, decode_seconds_per_token=0.02)
    for name, seconds in (("a", 0.2), ("b", 0.2), ("c", 0.5)):
        warmed.observe_first_token(name, ttft=seconds, ahead_tokens=0, uncached_tokens=2048)
    assert 0.02 * 2.0 < warmed.decode_seconds_per_token("c") <= 0.02 * 2.5 * 1.01  # one sample: near 2.5x
    assert warmed.decode_seconds_per_token("a") == pytest.approx(0.02)
    quick = SpeedEstimator(10_000.0, decode_seconds_per_token=0.02)
    for _ in range(3):
        for name, base in (("a", 0.05), ("b", 0.05), ("c", 0.01)):
            quick.observe_first_token(name, ttft=base, ahead_tokens=0, uncached_tokens=10)
    assert quick.decode_seconds_per_token("c") == pytest.approx(0.02)  # never scaled down


def test_a_newcomers_first_decode_window_moves_the_fleets_pace_not_the_prior() -> None:
    """The configured prior (0.02 s/token) may be far from this fleet's pace: a first window that
    read slow under load would then price a newcomer several times above the others, and an
    instance dispatch avoids is never read again."""
    est = SpeedEstimator(10_000.0, decode_seconds_per_token=0.02, rebuild_every=0)
    window = {"requests": 20.0, "prefill_seconds": 0.001, "computed_tokens": 8.0}
    for _ in range(30):
        est.observe_engine("old", **window, decode_seconds_per_token=0.003)
    assert est.decode_seconds_per_token("new") == pytest.approx(0.003, rel=0.01)
    est.observe_engine("new", **{**window, "requests": 2.0}, decode_seconds_per_token=0.01)
    step = 1.0 - 0.8**2
    assert est.decode_seconds_per_token("new") == pytest.approx(0.003 + step * (0.01 - 0.003), rel=0.01)


def test_one_stalled_first_answer_does_not_make_a_newcomer_look_slow() -> None:
    est = SpeedEstimator(10_000.0, rebuild_every=0)
    for _ in range(5):
        for name in ("a", "b"):
            est.observe_first_token(name, ttft=0.005, ahead_tokens=0, uncached_tokens=8, exact=True)
    est.observe_first_token("new", ttft=0.2, ahead_tokens=0, uncached_tokens=8, exact=True)  # a stall
    assert est.params("new")[1] <= est.params("a")[1] * 1.01  # it gets traffic, and learns from it
    for _ in range(3):
        est.observe_first_token("new", ttft=0.2, ahead_tokens=0, uncached_tokens=8, exact=True)
    assert est.params("new")[1] > 0.1  # three samples say it: its fixed latency counts


def test_a_restart_lets_one_measurement_replace_a_stale_estimate() -> None:
    """A card misread four times slow: after ``restart`` one clean sample nearly sets its speed,
    where without it the clamp and the moving average would hold it well below."""

    def misread() -> SpeedEstimator:
        est = SpeedEstimator(1000.0, weights={"a": 1.0, "b": 1.0, "c": 1.0})
        for _ in range(6):
            for name, speed in (("a", 1000.0), ("b", 1000.0), ("c", 250.0)):
                est.observe_first_token(
                    name, ttft=2048 / speed, ahead_tokens=0, uncached_tokens=2048, exact=True
                )
        return est

    kept, fresh = misread(), misread()
    assert kept.relative("c") == pytest.approx(fresh.relative("c"))
    assert kept.relative("c") < 0.3
    fresh.restart("c", 100)  # a prompt too small to teach a speed replaces nothing
    assert fresh.evidence("c") == kept.evidence("c")
    fresh.restart("c", 2048)
    fresh.restart("unknown", 2048)  # nothing to restart: no error, nothing learned
    assert "unknown" not in fresh.snapshot()
    for est in (kept, fresh):
        est.observe_first_token("c", ttft=2.048, ahead_tokens=0, uncached_tokens=2048, exact=True)
    assert kept.speed("c") < 0.5 * kept.speed("a")
    assert fresh.speed("c") == pytest.approx(fresh.speed("a"), rel=0.15)
    assert fresh.samples("c") == 7 and fresh.evidence("c") < 1.0
