"""Admission: send, wait or refuse, over random fleets."""

from __future__ import annotations

from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from taogate.dispatch.admission import decide, retry_after_seconds
from taogate.dispatch.policy import LeastBusy, Policy, RoundRobin
from taogate.dispatch.types import Decision, InstanceView, Refuse, RequestFacts, Send, Wait


def req(long: bool = False, model: str | None = "m") -> RequestFacts:
    return RequestFacts(model=model, prompt_tokens=8000 if long else 100, long=long)


def test_sends_to_a_candidate_with_room() -> None:
    views = [InstanceView("a", inflight=2, cap=2), InstanceView("b", inflight=1, cap=2)]
    assert decide(req(), views, LeastBusy()) == Send("b", "least_load")


def test_waits_when_every_eligible_instance_is_at_its_cap() -> None:
    views = [InstanceView("a", inflight=2, cap=2), InstanceView("b", inflight=8, cap=8)]
    assert decide(req(), views, LeastBusy()) == Wait()


def test_overflow_only_when_primaries_are_full() -> None:
    over = InstanceView("hosted", overflow=True, cap=4)
    assert decide(req(), [InstanceView("a", inflight=1, cap=2), over], LeastBusy()) == Send("a", "least_load")
    assert decide(req(), [InstanceView("a", inflight=2, cap=2), over], LeastBusy()) == Send(
        "hosted", "overflow"
    )
    full_over = InstanceView("hosted", overflow=True, cap=4, inflight=4)
    assert decide(req(), [InstanceView("a", inflight=2, cap=2), full_over], LeastBusy()) == Wait()
    # No primary up at all: the overflow still serves.
    down = InstanceView("a", available=False)
    assert decide(req(), [down, over], LeastBusy()) == Send("hosted", "overflow")


def test_refuses_when_nothing_can_ever_serve() -> None:
    assert decide(req(), [], LeastBusy()) == Refuse("no_instance")
    assert decide(req(), [InstanceView("a", available=False)], LeastBusy()) == Refuse("no_instance")
    assert decide(req(), [InstanceView("a")], LeastBusy(), exclude={"a"}) == Refuse("no_instance")


def test_model_awareness() -> None:
    views = [InstanceView("a", models=frozenset({"llama"})), InstanceView("b", models=frozenset({"qwen"}))]
    assert decide(req(model="qwen"), views, LeastBusy()) == Send("b", "least_load")
    assert decide(req(model="gpt"), views, LeastBusy()) == Refuse("model_not_found")
    # An instance that has not listed its models yet might serve it.
    assert decide(req(model="gpt"), [*views, InstanceView("c")], LeastBusy()) == Send("c", "least_load")
    # Served only by a down instance: not a missing model, an outage.
    down = [InstanceView("a", models=frozenset({"llama"}), available=False)]
    assert decide(req(model="llama"), down, LeastBusy()) == Refuse("no_instance")
    assert decide(req(model=None), views, RoundRobin()) == Send("a", "round_robin")


def test_retries_never_return_to_the_failed_instance() -> None:
    views = [InstanceView("a"), InstanceView("b", inflight=5)]
    assert decide(req(), views, LeastBusy(), exclude=frozenset({"a"})) == Send("b", "least_load")


def test_channels_and_fallback() -> None:
    views = [InstanceView("l", role="long"), InstanceView("s", role="short")]
    assert decide(req(long=True), views, LeastBusy()) == Send("l", "least_load")
    assert decide(req(long=False), views, LeastBusy()) == Send("s", "least_load")
    # Own channel busy (at cap): wait for it, the other channel is not borrowed.
    busy = [InstanceView("l", role="long", inflight=1, cap=1), InstanceView("s", role="short")]
    assert decide(req(long=True), busy, LeastBusy()) == Wait()
    # Own channel down: fall back, and say so.
    down = [InstanceView("l", role="long", available=False), InstanceView("s", role="short")]
    assert decide(req(long=True), down, LeastBusy()) == Send("s", "least_load", channel_fallback=True)
    # "any" instances serve both channels.
    mixed = [InstanceView("x", role="any"), InstanceView("s", role="short", available=False)]
    assert decide(req(long=False), mixed, LeastBusy()) == Send("x", "least_load")


def test_retry_after() -> None:
    assert retry_after_seconds(0, 10.0) == 1
    assert retry_after_seconds(99, 10.0) == 10
    assert retry_after_seconds(10_000, 1.0) == 60
    assert retry_after_seconds(5, 0.0) == 10
    assert retry_after_seconds(5, 0.0, unknown=3) == 3
    assert retry_after_seconds(5, float("nan")) == 10


fleets = st.lists(
    st.builds(
        InstanceView,
        name=st.sampled_from([f"i{k}" for k in range(8)]),
        role=st.sampled_from(["any", "long", "short"]),
        models=st.sampled_from([frozenset(), frozenset({"m"}), frozenset({"x"}), frozenset({"m", "x"})]),
        available=st.booleans(),
        inflight=st.integers(0, 5),
        cap=st.integers(1, 4),
        prefill_tokens=st.integers(0, 50_000),
        speed=st.floats(100, 10_000),
        overflow=st.booleans(),
    ),
    max_size=8,
    unique_by=lambda v: v.name,
)


@settings(max_examples=120, deadline=None)
@given(
    views=fleets,
    long=st.booleans(),
    model=st.sampled_from(["m", "x", "y", None]),
    exclude=st.frozensets(st.sampled_from([f"i{k}" for k in range(8)]), max_size=3),
    strategy=st.sampled_from(["least_busy", "affinity", "round_robin"]),
    key=st.none() | st.integers(0, 2**64 - 1),
)
def test_property_admission_invariants(
    *,
    views: list[InstanceView],
    long: bool,
    model: str | None,
    exclude: frozenset[str],
    strategy: str,
    key: int | None,
) -> None:
    policy = RoundRobin() if strategy == "round_robin" else LeastBusy(affinity=strategy == "affinity")
    facts = RequestFacts(model=model, prompt_tokens=5000 if long else 200, long=long, prefix_key=key)
    decision = decide(facts, views, policy, exclude)

    usable = [v for v in views if v.available and v.serves(model) and v.name not in exclude]
    primaries = [v for v in usable if not v.overflow]
    own = [v for v in primaries if v.role in (("long", "any") if long else ("short", "any"))]
    eligible = own or primaries
    if isinstance(decision, Send):
        picked = next(v for v in views if v.name == decision.instance)
        assert picked.available and picked.serves(model) and picked.name not in exclude
        assert picked.has_room  # never an at-cap instance
        if picked.overflow:
            assert decision.reason == "overflow"
            assert not any(v.has_room for v in eligible)  # only when every eligible primary is full
        else:
            assert picked in eligible
            assert decision.channel_fallback == (not own)  # wrong channel only as a declared fallback
    elif isinstance(decision, Wait):
        # Work-conserving: waiting only when nothing eligible, overflow included, has room...
        assert not any(v.has_room for v in usable if v in eligible or v.overflow)
        # ...and only when something could take it later.
        assert eligible or any(v.overflow for v in usable)
    else:
        assert decision.reason in ("no_instance", "model_not_found")
        if decision.reason == "no_instance":
            assert not eligible and not any(v.overflow for v in usable)
        else:
            assert model is not None and not any(v.serves(model) for v in views)


def _decide_as_filters(
    req: RequestFacts, views: list[InstanceView], policy: Policy, exclude: frozenset[str]
) -> Decision:
    """``decide`` as it was written before its one pass, filter by filter: the reference."""
    model = req.model
    if model is not None and any(v.models for v in views) and not any(v.serves(model) for v in views):
        return Refuse("model_not_found")
    usable = [v for v in views if v.available and v.serves(model) and v.name not in exclude]
    own = ("long", "any") if req.long else ("short", "any")
    primaries = [v for v in usable if not v.overflow]
    eligible = [v for v in primaries if v.role in own]
    fallback = False
    if not eligible and primaries:
        eligible, fallback = primaries, True
    room = [v for v in eligible if v.has_room]
    if room:
        send = policy.choose(req, room)  # (it handed the policy the eligible names too: none reads them)
        if send is not None:
            return replace(send, channel_fallback=True) if fallback else send
    overflow = [v for v in usable if v.overflow]
    spare = [v for v in overflow if v.has_room]
    if spare:
        target = max(spare, key=lambda v: (v.cap - v.inflight, v.name))
        return Send(target.name, "overflow", channel_fallback=fallback)
    if eligible or overflow:
        return Wait()
    return Refuse("no_instance")


@settings(max_examples=300, deadline=None)
@given(
    views=fleets,
    long=st.booleans(),
    model=st.sampled_from(["m", "x", "y", None]),
    exclude=st.frozensets(st.sampled_from([f"i{k}" for k in range(8)]), max_size=3),
    strategy=st.sampled_from(["least_busy", "affinity", "round_robin"]),
)
def test_property_one_pass_decides_as_the_filters_did(
    *, views: list[InstanceView], long: bool, model: str | None, exclude: frozenset[str], strategy: str
) -> None:
    def policy() -> Policy:
        return RoundRobin() if strategy == "round_robin" else LeastBusy(affinity=strategy == "affinity")

    facts = RequestFacts(model=model, prompt_tokens=5000 if long else 200, long=long)
    assert decide(facts, views, policy(), exclude) == _decide_as_filters(facts, views, policy(), exclude)
