"""Fixed latency, waiting requests as evidence, and prefill booked net of warm prefixes."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from taogate.dispatch.load import LoadModel, expected_latency, expected_prefill, expected_ttft
from taogate.dispatch.pending import Pending, speed_bound
from taogate.dispatch.policy import LeastBusy
from taogate.dispatch.slow import slow_instances
from taogate.dispatch.speed import SpeedEstimator
from taogate.dispatch.types import InstanceView, RequestFacts
from taogate.fleet.fleet import Fleet, specs_from_settings
from taogate.fleet.lease import Lease
from tests.conftest import gateway_settings

# --- fixed latency ----------------------------------------------------------------------------------


def test_short_prompts_alone_do_not_make_an_identical_card_look_slow() -> None:
    """ttft = base + work / speed: a card fed only 40-token prompts learns its base, not a low speed."""
    est = SpeedEstimator(10_000.0)
    base, speed = 0.015, 40_000.0
    for _ in range(30):
        est.observe_first_token("short", ttft=base + 40 / speed, ahead_tokens=0, uncached_tokens=40)
        est.observe_first_token("long", ttft=base + 3000 / speed, ahead_tokens=0, uncached_tokens=3000)
    assert est.base_latency("short") == pytest.approx(base + 40 / speed, rel=0.05)
    assert est.speed("short") / est.speed("long") > 0.9
    assert not slow_instances(est.snapshot())


def test_speed_is_learned_net_of_the_fixed_latency() -> None:
    est = SpeedEstimator(10_000.0)
    for k in range(40):
        work = 100 if k % 2 else 4000
        est.observe_first_token("a", ttft=0.02 + work / 20_000.0, ahead_tokens=0, uncached_tokens=work)
    assert est.base_latency("a") == pytest.approx(0.025, rel=0.1)
    assert est.speed("a") == pytest.approx(20_000.0, rel=0.1)


def test_a_card_seen_only_through_cache_hits_is_still_ranked_by_its_fixed_latency() -> None:
    """Small work everywhere (prefix-cache hits): no speed evidence, but a 2.5x step time shows."""
    est = SpeedEstimator(10_000.0)
    for _ in range(10):
        for name in ("a", "b", "c"):
            est.observe_first_token(name, ttft=0.012, ahead_tokens=0, uncached_tokens=40)
        est.observe_first_token("slow", ttft=0.030, ahead_tokens=0, uncached_tokens=40)
    assert est.speed("slow") == pytest.approx(0.4 * est.speed("a"), rel=0.05)
    assert est.speed("a") == est.speed("b") == est.speed("c")


def test_a_lower_fixed_latency_never_raises_a_speed() -> None:
    est = SpeedEstimator(10_000.0)
    for _ in range(10):
        est.observe_first_token("a", ttft=0.03, ahead_tokens=0, uncached_tokens=40)
        est.observe_first_token("near", ttft=0.003, ahead_tokens=0, uncached_tokens=40)
    assert est.speed("near") == 10_000.0  # the fleet's scale, not above it
    assert est.speed("a") == 2_500.0  # 10x the other's fixed latency: scaled down, by at most 4x


def test_booked_work_ahead_is_trusted_less_than_measured_work() -> None:
    """The same wrong sample moves the estimate less when most of its work was only booked."""
    own = SpeedEstimator(1000.0)
    booked = SpeedEstimator(1000.0)
    for est in (own, booked):
        est.observe_first_token("a", ttft=1.0, ahead_tokens=0, uncached_tokens=1000)
    own.observe_first_token("a", ttft=1.0, ahead_tokens=0, uncached_tokens=4000)
    booked.observe_first_token("a", ttft=1.0, ahead_tokens=3000, uncached_tokens=1000)
    assert booked.speed("a") < own.speed("a")


# --- waiting requests as evidence -------------------------------------------------------------------


def test_speed_bound_from_a_request_still_waiting() -> None:
    assert speed_bound([]) == math.inf
    assert speed_bound([Pending(4000, 0.5)]) == pytest.approx(8000.0)
    assert speed_bound([Pending(4000, 0.5)], base=0.1) == pytest.approx(10_000.0)
    assert speed_bound([Pending(4000, 2.0), Pending(8000, 1.0)]) == pytest.approx(2000.0)
    # A non-stream request's decode allowance: no bound until it has waited longer than that.
    assert speed_bound([Pending(4000, 0.3, allowance=0.32)]) == math.inf
    assert speed_bound([Pending(4000, 0.0)]) == math.inf


@settings(max_examples=200, deadline=None)
@given(
    pending=st.lists(
        st.builds(
            Pending,
            st.floats(1, 1e6),
            st.floats(0, 1e4),
            st.floats(0, 10),
        ),
        max_size=8,
    ),
    base=st.floats(0, 1),
)
def test_property_speed_bound_is_positive_and_only_tightens(pending: list[Pending], base: float) -> None:
    bound = speed_bound(pending, base)
    assert bound > 0
    assert speed_bound([*pending, Pending(1.0, 1e9)], base) <= bound


def _fleet() -> Fleet:
    settings = gateway_settings(["http://a", "http://b"], dispatch={"scrape_interval": 0})
    fleet = Fleet(settings, SpeedEstimator(10_000.0))
    fleet.apply(settings, specs_from_settings(settings))
    return fleet


def test_a_late_first_token_lowers_the_speed_dispatch_sees_at_once() -> None:
    fleet = _fleet()
    a = fleet.get("i0")
    lease = Lease(a, 4000, lambda _: None, sent_at=0.0, stream=True)
    # On time (4,000 tokens at 10k tokens/s is 0.4 s): nothing changes.
    assert {v.name: v.speed for v in fleet.views(0.3)} == {"i0": 10_000.0, "i1": 10_000.0}
    # Two seconds without a first token: at most 2,000 tokens/s.
    views = {v.name: v for v in fleet.views(2.0)}
    assert views["i0"].speed == pytest.approx(2000.0)
    assert views["i1"].speed == 10_000.0
    lease.first_token()
    assert not a.pending
    assert {v.name: v.speed for v in fleet.views(2.0)}["i0"] == 10_000.0
    lease.release()
    assert (a.inflight, a.prefilling, a.prefill_tokens, a.pending) == (0, 0, 0, {})


def test_non_stream_leases_allow_for_decode_or_say_nothing() -> None:
    fleet = _fleet()
    a = fleet.get("i0")
    Lease(a, 1000, lambda _: None, sent_at=0.0, stream=False, max_tokens=100)
    Lease(a, 1000, lambda _: None, sent_at=0.0, stream=False, max_tokens=None)
    pending = list(a.waiting(5.0, 0.02))
    assert pending == [Pending(1000, 5.0, 2.0)]  # the second (no max_tokens) is no evidence


@settings(max_examples=100, deadline=None)
@given(
    ops=st.lists(st.tuples(st.integers(0, 5), st.sampled_from(["first", "release"])), max_size=40),
    sizes=st.lists(st.integers(1, 10_000), min_size=6, max_size=6),
)
def test_property_leases_leave_nothing_pending(ops: list[tuple[int, str]], sizes: list[int]) -> None:
    fleet = _fleet()
    inst = fleet.get("i0")
    leases = [Lease(inst, n, lambda _: None, sent_at=float(k)) for k, n in enumerate(sizes)]
    for k, op in ops:
        getattr(leases[k], "first_token" if op == "first" else "release")()
        assert len(inst.pending) == inst.prefilling
        assert sum(lease.tokens for lease in inst.pending) == inst.prefill_tokens
    for lease in leases:
        lease.release()
    assert (inst.inflight, inst.prefilling, inst.prefill_tokens, inst.pending) == (0, 0, 0, {})


# --- load and booking -------------------------------------------------------------------------------


def test_fixed_latency_and_decode_pace_count() -> None:
    view = InstanceView("a", speed=1000.0, base_latency=0.05, decode_seconds_per_token=0.02)
    assert expected_ttft(view, 1000) == pytest.approx(1.05)
    assert expected_latency(view, 1000, max_tokens=4) == pytest.approx(1.05 + 4 * 0.02)
    assert expected_latency(view, 1000, max_tokens=10_000) == pytest.approx(1.05 + 16 * 0.02)
    assert expected_latency(view, 1000, None, LoadModel(decode_horizon=0)) == pytest.approx(1.05)


def test_expected_prefill_nets_out_a_warm_prefix() -> None:
    assert expected_prefill(4096) == 4096
    assert expected_prefill(4096, warm_prefix=4000) == 96
    assert expected_prefill(100, warm_prefix=4000) == 1


def test_a_slow_decoder_loses_a_cache_hit_it_would_win_on_ttft() -> None:
    fast = InstanceView("fast", speed=10_000.0, decode_seconds_per_token=0.013)
    slow = InstanceView("slow", speed=10_000.0, decode_seconds_per_token=0.033)
    req = RequestFacts("m", 40, long=False, max_tokens=16)
    for _ in range(4):
        send = LeastBusy().choose(req, [slow, fast])
        assert send is not None and send.instance == "fast"


def test_a_shared_decode_term_does_not_turn_queued_work_into_a_tie() -> None:
    """A hung instance holding one tiny request must not tie with idle ones because every cost also
    carries the same 16 x 20 ms of decode (the 1 % tie tolerance applies to the TTFT too)."""
    busy = InstanceView("a", inflight=1, prefill_tokens=3, speed=10_000.0, decode_seconds_per_token=0.02)
    idle = InstanceView("b", speed=10_000.0, decode_seconds_per_token=0.02)
    policy = LeastBusy()
    req = RequestFacts("m", 3, long=False, max_tokens=16)
    for _ in range(4):
        send = policy.choose(req, [busy, idle])
        assert send is not None and send.instance == "b"
