"""The route receipt: a pure function of the request, the candidates and the pick."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from taogate.dispatch.cache_model import PrefixCacheModel
from taogate.dispatch.load import estimate
from taogate.dispatch.policy import LeastBusy
from taogate.dispatch.receipt import MAX_CHARS, explain, terms
from taogate.dispatch.types import InstanceView, RequestFacts, Send
from taogate.fleet.cache_state import InstanceCache
from tests.unit.test_dispatch_cache_affinity import ModelView

REQ = RequestFacts("m", 3040, long=False, prefix_key=9, prefix_tokens=3000, max_tokens=16)


def test_the_terms_add_up_to_the_estimate() -> None:
    view = InstanceView(
        "a", speed=8000.0, base_latency=0.02, prefill_work=6000, decode_seconds_per_token=0.01
    )
    t = terms(view, REQ, 2992.0, estimate(view, 48, 16)[1], "computed")
    ttft, latency = estimate(view, 48, 16)
    assert abs(t.fixed + t.queued + t.own - ttft) < 1e-9
    assert abs(t.total - latency) < 1e-9 and t.adjust == 0.0
    assert t.work == 48 and abs(t.queued - 6000 / 8000) < 1e-9


def test_a_receipt_names_the_pick_the_runner_up_and_the_evidence() -> None:
    held = PrefixCacheModel()
    held.computed(held.dispatched(9, 3000, 3040, 16))
    views = [
        InstanceView("a", cache=ModelView(held), prefill_work=2000),
        InstanceView("b", cache=ModelView(PrefixCacheModel())),
    ]
    lb = LeastBusy(affinity=True)
    send = lb.choose(REQ, views)
    assert send is not None and send.instance == "a"
    line = explain(REQ, views, send, lb, {"a": "computed", "b": "none"})
    chosen, runner = line.split("; runner-up ")
    assert chosen.startswith("affinity_hit: a est=") and "(48 tok, hit 2992 computed)" in chosen
    assert runner.startswith("b est=") and "(3040 tok, hit 0 none)" in runner


def test_an_overflow_pick_says_so() -> None:
    line = explain(REQ, [InstanceView("a")], Send("spare", "overflow"), LeastBusy(), {})
    assert line.startswith("overflow: spare")


@settings(max_examples=60, deadline=None)
@given(
    names=st.lists(st.text(min_size=1, max_size=300), min_size=1, max_size=6, unique=True),
    work=st.integers(0, 10**9),
)
def test_property_bounded_ascii_one_line(names: list[str], work: int) -> None:
    views = [InstanceView(n, prefill_work=work, speed=1e-3) for n in names]
    lb = LeastBusy()
    send = lb.choose(REQ, views)
    assert send is not None
    line = explain(REQ, views, send, lb, {})
    assert len(line) <= MAX_CHARS and line.isascii() and "\n" not in line and "\r" not in line


def test_the_evidence_says_when_an_in_flight_follower_is_priced_as_a_hit() -> None:
    cache = InstanceCache()
    follower = RequestFacts("m", 2040, long=False, prefix_key=1, prefix_tokens=2000, max_tokens=16)
    assert cache.evidence(follower) == "none"
    cache.dispatched(follower)
    assert cache.evidence(follower) == "in_flight" and cache.hit(follower) == 2000.0  # as on vLLM
    other = RequestFacts("m", 2040, long=False, prefix_key=2, prefix_tokens=2000, max_tokens=16)
    cache.dispatched(other)
    cache.finished(cache.dispatched(other), cached=0)  # a follower in flight missed here
    assert cache.evidence(follower) == "sent" and cache.hit(follower) == 0.0
