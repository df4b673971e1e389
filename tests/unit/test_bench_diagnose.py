"""The bisection's decision rule on synthetic evidence (no servers)."""

from __future__ import annotations

from taogate.bench.diagnose import EXIT_CODES, Evidence, decide, own_speeds, peak_per_instance, too_long
from taogate.bench.report import Summary, summarize
from taogate.bench.runner import Sample


def run(latencies: dict[str, list[float]], label: str = "run") -> Summary:
    samples = [
        Sample(i, "g", 0.0, lat, 0.1, 200, inst, prompt_tokens=4096)
        for i, (inst, lat) in enumerate((inst, lat) for inst, lats in latencies.items() for lat in lats)
    ]
    return summarize(label, samples)


EVEN = {f"i{n}": [1.0, 1.1, 1.2, 1.0] for n in range(4)}
PILED = {**{f"i{n}": [1.0, 1.1, 1.0, 1.0] for n in range(3)}, "i3": [2.0, 4.0, 6.0, 8.0]}
SPREAD = {**{f"i{n}": [1.0, 1.1, 1.0, 1.3, 1.2] for n in range(3)}, "i3": [2.0]}
FAST = {f"i{n}": 16000.0 for n in range(4)}
SLOW_I2 = {**FAST, "i2": 4000.0}


def test_homogeneous_and_unchanged_is_balanced() -> None:
    v = decide(Evidence(run(EVEN), run(EVEN), 32, 8, FAST))
    assert v.kind == "balanced" and v.exit_code == 0 and v.instance is None
    assert any("max latency cap 32 / cap 8" in line for line in v.evidence)


def test_big_drop_when_the_cap_is_lowered_is_dispatch() -> None:
    v = decide(Evidence(run(PILED), run(SPREAD), 32, 8, FAST))
    assert v.kind == "dispatch" and v.exit_code == 1
    assert "8" in v.headline


def test_dispatch_wins_over_a_slow_instance_but_names_it() -> None:
    v = decide(Evidence(run(PILED), run(SPREAD), 32, 8, SLOW_I2))
    assert v.kind == "dispatch"
    assert any(line.startswith("also: i2") for line in v.evidence)


def test_slow_probe_without_dispatch_gain_names_the_instance() -> None:
    v = decide(Evidence(run(PILED), run(PILED), 32, 8, SLOW_I2))
    assert v.kind == "slow" and v.instance == "i2" and v.exit_code == 2
    assert "i2" in v.headline


def test_a_card_is_judged_by_its_best_try_as_a_busy_machine_only_slows_one() -> None:
    # Seen on the real fast + slow pair (the slow card's prefill 4x slower): busy tries pulled the
    # fast card's median down to 11.6k, within 0.6x of the slow card's 5.35k.
    tries = {"fast": [5_730.0, 9_000.0, 11_615.0, 20_000.0, 28_381.0], "slow": [2_718.0, 5_350.0, 6_858.0]}
    speeds = own_speeds({**tries, "down": []})
    assert speeds == {"fast": 28_381.0, "slow": 6_858.0, "down": 0.0}
    del speeds["down"]
    v = decide(Evidence(run(EVEN), run(EVEN), 32, 8, speeds, probe_range={"fast": (5_730.0, 28_381.0)}))
    assert v.kind == "slow" and v.instance == "slow"
    assert any("fast 28,381 [5,730-28,381]" in line for line in v.evidence)


def test_learned_relative_speed_is_used_when_there_is_no_probe() -> None:
    rel = {"i0": 1.0, "i1": 1.05, "i2": 0.98, "i3": 0.3}
    v = decide(Evidence(run(EVEN), run(EVEN), 32, 8, {}, rel))
    assert v.kind == "slow" and v.instance == "i3"


def test_an_instance_whose_probes_all_failed_is_judged_by_the_learned_speeds() -> None:
    # Left out of the probes' comparison, it would pass for as fast as the others.
    probes = {**FAST, "i3": 0.0}
    rel = {"i0": 1.0, "i1": 1.05, "i2": 0.98, "i3": 0.3}
    v = decide(Evidence(run(EVEN), run(EVEN), 32, 8, probes, rel))
    assert v.kind == "slow" and v.instance == "i3"
    assert any(line.startswith("no probe of i3 came back") for line in v.evidence)


def test_a_mildly_slower_instance_is_not_flagged() -> None:
    v = decide(Evidence(run(EVEN), run(EVEN), 32, 8, {**FAST, "i1": 12000.0}))
    assert v.kind == "balanced"


def test_imbalance_without_cause_points_inside_vllm() -> None:
    v = decide(Evidence(run(PILED), run(PILED), 32, 8, FAST, cache_hit_rate=0.8))
    assert v.kind == "inside" and v.exit_code == 2
    assert any("prefix-cache hit rate" in line for line in v.evidence)


def test_no_successful_request_is_an_error() -> None:
    failed = summarize("x", [Sample(0, "g", 0, 1, None, 503, None, error="down")])
    v = decide(Evidence(failed, run(EVEN), 32, 8, FAST))
    assert v.kind == "error" and v.exit_code == 3 == EXIT_CODES["error"]


def test_a_slow_instance_dispatch_already_routes_around_is_the_verdict() -> None:
    # i3 is probed slow and got 1 of 13 requests in run A (under 0.75 x its fair quarter): even though
    # the lowered cap cut max latency, what remains to fix is the instance itself.
    around = {**{f"i{n}": [1.0, 1.1, 1.0, 1.0] for n in range(3)}, "i3": [8.0]}
    slow_i3 = {**FAST, "i3": 4000.0}
    v = decide(Evidence(run(around), run(SPREAD), 32, 8, slow_i3))
    assert v.kind == "slow" and v.instance == "i3"
    assert any("dispatch already gives i3 only 8%" in line for line in v.evidence)


def test_a_slow_instance_that_served_nothing_is_routed_around_too() -> None:
    around = {f"i{n}": [1.0, 1.1, 1.0, 8.0] for n in range(3)}  # i3 absent: it served no request
    v = decide(Evidence(run(around), run(SPREAD), 32, 8, {**FAST, "i3": 4000.0}))
    assert v.kind == "slow" and v.instance == "i3"


def test_a_drop_when_the_lower_cap_never_bound_is_noise_not_dispatch() -> None:
    """8 requests at a time over 4 instances never put more than 8 on one: a cap of 8 changes
    nothing, so a max-latency difference between the runs is noise (seen in CI on a busy machine)."""
    v = decide(Evidence(run(PILED), run(SPREAD), 32, 8, FAST, peak_per_instance=8))
    assert v.kind != "dispatch"
    assert any("never bound" in line for line in v.evidence)
    v = decide(Evidence(run(PILED), run(SPREAD), 32, 8, FAST, peak_per_instance=9))
    assert v.kind == "dispatch"


def test_peak_per_instance_counts_overlaps_on_one_instance() -> None:
    samples = [
        Sample(0, "g", 0.0, 2.0, 0.1, 200, "i0"),
        Sample(1, "g", 1.0, 3.0, 0.1, 200, "i0"),
        Sample(2, "g", 2.0, 4.0, 0.1, 200, "i0"),  # starts as the first ends: two at once, not three
        Sample(3, "g", 0.0, 9.0, 0.1, 200, "i1"),
        Sample(4, "g", 0.0, 9.0, 0.1, 0, None),  # no instance: not counted
    ]
    assert peak_per_instance(samples) == 2
    assert peak_per_instance([]) == 0


STALLED = {**EVEN, "i1": [1.0, 1.1, 5.0, 1.0]}  # one request held up: max/mean over 2
STALLED_TOO = {**EVEN, "i2": [1.0, 4.5, 1.0, 1.0]}


def test_one_stall_in_one_of_two_alike_runs_is_balanced() -> None:
    """The cap never bound, so A and B are the same load twice: a stall that lifts one run's max
    alone is the machine, an imbalance inside vLLM would show in both."""
    assert run(STALLED).max_over_mean > 2 >= run(EVEN).max_over_mean
    for a, b in ((STALLED, EVEN), (EVEN, STALLED)):
        v = decide(Evidence(run(a), run(b), 32, 8, FAST, peak_per_instance=4))
        assert v.kind == "balanced", v
    v = decide(Evidence(run(STALLED), run(EVEN), 32, 8, FAST, peak_per_instance=4))
    assert any("the same load twice" in line for line in v.evidence)


def test_an_imbalance_in_both_alike_runs_points_inside_vllm() -> None:
    v = decide(Evidence(run(STALLED), run(STALLED_TOO), 32, 8, FAST, peak_per_instance=4))
    assert v.kind == "inside"


def test_when_the_cap_bound_the_configured_run_alone_is_judged() -> None:
    # Run B had a different dispatch: its better max/mean is not a second try of run A's.
    slower = {f"i{n}": [2.0, 2.2, 2.4, 4.0] for n in range(4)}  # max/mean within 2, max near A's
    v = decide(Evidence(run(STALLED), run(slower), 32, 8, FAST, peak_per_instance=9))
    assert v.kind == "inside"
    v = decide(Evidence(run(STALLED), run(slower), 32, 8, FAST))  # peak unknown: likewise
    assert v.kind == "inside"


def test_only_a_refused_length_makes_the_probe_shorter() -> None:
    # vLLM 0.32's wordings for a prompt past the context, and for max_tokens past what is left.
    assert too_long("This model's maximum context length is 4096 tokens. However, your request has 5120")
    assert too_long("max_tokens=16 cannot be greater than max_model_len=4096. Please request fewer")
    # A shorter prompt would be refused alike: no reason to shrink the probe.
    assert not too_long("Unsupported Media Type: Only 'application/json' is allowed")
    assert not too_long("The model `other` does not exist.")
    assert not too_long(None)
