"""An instance's speed bound over its pending leases (``Instance._pending_bound``, over what ``book``
kept of each lease) is ``dispatch.pending.speed_bound`` over ``Instance.waiting`` (which reads the
leases themselves), float for float, whatever leases come, get a first token or go."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from taogate.dispatch.pending import speed_bound
from taogate.fleet.instance import Instance, InstanceSpec
from taogate.fleet.lease import Lease

LEASES = st.lists(
    st.tuples(
        st.integers(0, 5000),  # tokens
        st.floats(0, 10),  # sent at
        st.booleans(),  # stream
        st.none() | st.integers(0, 512),  # max_tokens
        st.sampled_from(["keep", "first", "release"]),
    ),
    max_size=12,
)


@settings(max_examples=300, deadline=None)
@given(
    leases=LEASES,
    now=st.floats(0, 20),
    tpot=st.floats(0, 0.2) | st.just(float("inf")),
    base=st.floats(-1, 2),
)
def test_the_kept_bound_is_the_bound_over_the_waiting_leases(
    leases: list[tuple[int, float, bool, int | None, str]], now: float, tpot: float, base: float
) -> None:
    inst = Instance(
        InstanceSpec("a", "http://127.0.0.1:9"),
        unhealthy_after=2,
        healthy_after=1,
        breaker_failures=3,
        breaker_cooldown=1.0,
    )
    for tokens, sent_at, stream, max_tokens, fate in leases:
        lease = Lease(inst, tokens, lambda _: None, sent_at=sent_at, stream=stream, max_tokens=max_tokens)
        if fate == "first":
            lease.first_token()
        elif fate == "release":
            lease.release()
    got = inst._pending_bound(now, tpot, base)
    want = speed_bound(inst.waiting(now, tpot), base)
    assert got == want  # never NaN: a NaN allowance fails ``seconds > 0`` on both sides
