"""Fair share in the gateway queue: keys served by their virtual token counters, classes within a key."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from hypothesis import given, settings
from hypothesis import strategies as st

from taogate.fleet.priority import FairOrder
from taogate.tenancy.fairshare import MAX_FLOWS, FairShare


@dataclass(eq=False)
class Item:
    tenant: str
    key: tuple[int, int]
    cost: int = field(default=1)


def test_the_key_with_the_fewest_recent_tokens_goes_first_classes_within_a_key() -> None:
    fair = FairShare()
    order: FairOrder[Item] = FairOrder(oldest_every=100, fair=fair)
    n = itertools.count()
    a1, a2, b1 = Item("a", (0, next(n))), Item("a", (-1, next(n))), Item("b", (5, next(n)))
    for item in (a1, a2, b1):
        order.add(item)
    fair.charge("b", 100)
    assert list(order.offers()) == [a2, a1, b1]  # a has used less; its urgent class first
    fair.charge("a", 500)
    assert list(order.offers()) == [b1, a2, a1]
    order.granted(b1)
    assert len(order) == 2 and b1 not in order and a1 in order


def test_a_key_that_starts_waiting_brings_no_credit_from_its_idle_time() -> None:
    fair = FairShare()
    order: FairOrder[Item] = FairOrder(oldest_every=100, fair=fair)
    fair.charge("a", 1_000)  # a was served while b was idle
    order.add(Item("a", (0, 0)))
    order.add(Item("b", (0, 1)))
    assert fair.counter("b") == 1_000  # lifted to the waiting keys' least: no banked credit


def test_weights_divide_the_charge() -> None:
    fair = FairShare({"big": 4.0})
    fair.charge("big", 400)
    fair.charge("small", 400)
    assert (fair.counter("big"), fair.counter("small")) == (100.0, 400.0)
    fair.configure({"small": 1.0})  # big revoked: its counter goes
    assert fair.counter("big") == 0.0


def test_flows_outlive_a_reload_and_the_least_served_half_goes_past_the_bound() -> None:
    fair = FairShare({"unified": 1.0, "team-a": 1.0})
    fair.charge("team-a", 10)
    fair.charge("flow:x", 10)
    fair.configure({"unified": 1.0})  # team-a revoked; the flow is no key of the table
    assert (fair.counter("team-a"), fair.counter("flow:x")) == (0.0, 10.0)
    for n in range(MAX_FLOWS - 1):
        fair.charge(f"flow:{n}", n)
    fair.charge("unified", 1)
    assert fair.counter("flow:x") == 10.0  # the bound: MAX_FLOWS flows beside the keys
    fair.charge("flow:new", 5)  # one too many: the half served least go, the keys stay
    assert fair.counter("flow:0") == 0.0 and fair.counter("flow:x") == 0.0
    assert fair.counter(f"flow:{MAX_FLOWS - 2}") == MAX_FLOWS - 2
    assert (fair.counter("unified"), fair.counter("flow:new")) == (1.0, 5.0)
    assert len(fair._served) <= MAX_FLOWS // 2 + 2


@settings(max_examples=150, deadline=None)
@given(
    heavy_costs=st.lists(st.integers(1, 400), min_size=1, max_size=8),
    light_costs=st.lists(st.integers(1, 400), min_size=1, max_size=8),
    weights=st.tuples(st.sampled_from([0.5, 1.0, 2.0]), st.sampled_from([0.5, 1.0, 3.0])),
    light=st.tuples(st.integers(1, 3), st.integers(1, 2)),  # every how many steps, how many
    heavy_burst=st.integers(10, 20),
)
def test_property_a_key_sending_ten_times_the_traffic_takes_no_more_than_its_share(
    heavy_costs: list[int],
    light_costs: list[int],
    weights: tuple[float, float],
    light: tuple[int, int],
    heavy_burst: int,
) -> None:
    """While the light key keeps a request waiting, the heavy key's weighted service exceeds the light
    key's by at most two requests' worth (VTC's bound), however much more it sends (ten to twenty
    times as many requests here)."""
    w_heavy, w_light = weights
    light_every, light_burst = light
    fair = FairShare({"heavy": w_heavy, "light": w_light})
    order: FairOrder[Item] = FairOrder(oldest_every=4, fair=fair)
    arrivals = itertools.count()
    bound = 2 * max(*heavy_costs, *light_costs) / min(weights)
    served = {"heavy": 0, "light": 0}
    backlogged = False
    for step in range(300):
        for k in range(heavy_burst):  # ten times (or more) the light key's requests
            order.add(Item("heavy", (0, next(arrivals)), heavy_costs[(step + k) % len(heavy_costs)]))
        if step % light_every == 0:
            for k in range(light_burst):
                order.add(Item("light", (0, next(arrivals)), light_costs[(step + k) % len(light_costs)]))
        light_waits = any(i.tenant == "light" for i in order.offers())
        if light_waits and not backlogged:
            served = {"heavy": 0, "light": 0}  # a new stretch of the light key waiting
        backlogged = light_waits
        item = next(order.offers())
        order.granted(item)
        fair.charge(item.tenant, item.cost)
        if backlogged:
            served[item.tenant] += item.cost
            excess = served["heavy"] / w_heavy - served["light"] / w_light
            assert excess <= bound, (step, served)
        # The stretch ends when the light key has nothing waiting (then it banks no credit).
        backlogged = backlogged and any(i.tenant == "light" for i in order.offers())
