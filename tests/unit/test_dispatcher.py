"""The gateway queue: a slot handed over in the same loop turn as a timeout or a cancellation is
never lost (found in review: the cap slot, its pending lease and a breaker trial leaked forever)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from taogate.dispatch.policy import make_policy
from taogate.dispatch.speed import SpeedEstimator
from taogate.dispatch.types import InstanceView, RequestFacts, Send
from taogate.errors import NoInstance, Overloaded
from taogate.fleet.dispatcher import Dispatcher
from taogate.fleet.fleet import Fleet, specs_from_settings
from taogate.instance_settings import InstanceSettings
from taogate.settings import Settings


def untimed(seconds: float) -> None:
    """A queue wait nobody records."""


FACTS = RequestFacts(model=None, prompt_tokens=10, long=False)


def one_slot_fleet(queue_timeout: float) -> tuple[Fleet, Dispatcher]:
    s = Settings(instances=[InstanceSettings(url="http://127.0.0.1:9", max_queue=1)])
    fleet = Fleet(s, SpeedEstimator())
    fleet.apply(s, specs_from_settings(s, {}))
    next(iter(fleet)).health.record(True, 0.0)
    d = Dispatcher(
        fleet, make_policy("least_busy"), queue_size=10, queue_timeout=queue_timeout, clock=time.monotonic
    )
    return fleet, d


async def test_a_timed_out_waiter_that_won_the_slot_keeps_it() -> None:
    fleet, d = one_slot_fleet(queue_timeout=0.05)
    inst = next(iter(fleet))
    got = d.try_acquire(FACTS)
    assert got is not None
    held = got[0]
    waiter = asyncio.create_task(d.wait_for_slot(FACTS, frozenset(), untimed))
    await asyncio.sleep(0)
    loop = asyncio.get_running_loop()
    loop.call_later(0.01, held.release)
    loop.call_soon(time.sleep, 0.1)  # a busy loop: the release and the timeout fall due in one turn
    lease, _ = await waiter
    assert inst.inflight == 1
    lease.release()
    assert (inst.inflight, inst.prefilling, inst.prefill_tokens, len(inst.pending)) == (0, 0, 0, 0)


async def test_a_cancelled_waiter_gives_a_handed_over_slot_back() -> None:
    fleet, d = one_slot_fleet(queue_timeout=5.0)
    inst = next(iter(fleet))
    got = d.try_acquire(FACTS)
    assert got is not None
    held = got[0]
    waiter = asyncio.create_task(d.wait_for_slot(FACTS, frozenset(), untimed))
    await asyncio.sleep(0)
    held.release()  # hands the slot to the waiter...
    waiter.cancel()  # ...whose client goes away in the same turn
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert (inst.inflight, len(inst.pending), d.queued) == (0, 0, 0)


def test_dispatch_sees_how_much_of_each_instance_s_booked_work_the_cache_leaves() -> None:
    """The views handed to the policy carry the speed estimator's uncached share per instance."""
    s = Settings(
        instances=[
            InstanceSettings(url="http://127.0.0.1:9", name="a"),
            InstanceSettings(url="http://127.0.0.1:8", name="b"),
        ]
    )
    fleet = Fleet(s, SpeedEstimator())
    fleet.apply(s, specs_from_settings(s, {}))
    for inst in fleet:
        inst.health.record(True, 0.0)
    for _ in range(8):  # "a" answers from its prefix cache: 40 of 4,096 tokens left to prefill
        fleet.speeds.observe_first_token(
            "a", ttft=0.1, ahead_tokens=0, uncached_tokens=40, prompt_tokens=4096
        )
    seen: list[dict[str, float]] = []

    class Spy:
        name = "spy"

        def choose(self, req: RequestFacts, candidates: Any) -> Send | None:
            seen.append({v.name: v.uncached_ratio for v in candidates})
            return Send(candidates[0].name, "least_load")

    d = Dispatcher(fleet, Spy(), queue_size=10, queue_timeout=1.0, clock=time.monotonic)
    assert d.could_send(FACTS, frozenset())
    got = d.try_acquire(FACTS)
    assert got is not None
    got[0].release()
    assert seen and seen[0]["b"] == 1.0 and seen[0]["a"] < 0.05


def test_an_instance_view_carries_each_value_in_its_named_field() -> None:
    """Instance.view builds its InstanceView positionally (for speed): every field must land by name."""
    s = Settings(instances=[InstanceSettings(url="http://127.0.0.1:9", name="a", max_queue=7, role="long")])
    fleet = Fleet(s, SpeedEstimator())
    fleet.apply(s, specs_from_settings(s, {}))
    inst = next(iter(fleet))
    inst.health.record(True, 0.0)
    inst.models = frozenset({"m"})
    inst.inflight, inst.prefilling, inst.prefill_tokens = 5, 2, 300
    view = inst.view(1.0, 123.0, 10.0, base_latency=0.25, tpot=0.02, uncached_ratio=0.5)
    expected = InstanceView(
        name="a",
        role="long",
        models=frozenset({"m"}),
        available=True,
        inflight=5,
        cap=7,
        prefill_tokens=300,
        decoding=3,
        prefilling=2,
        speed=123.0,
        base_latency=0.25,
        decode_seconds_per_token=0.02,
        uncached_ratio=0.5,
        engine=None,
        overflow=False,
    )
    assert view == expected


def test_a_follower_in_flight_is_booked_as_vllm_charges_it_and_a_first_token_makes_it_computed() -> None:
    """A follower of a prefix in flight is booked at its question alone, as vLLM charges it (it hits
    the blocks its leader schedules); the lease's first token marks the prefix computed there."""
    s = Settings(instances=[InstanceSettings(url="http://127.0.0.1:9", name="a")])
    fleet = Fleet(s, SpeedEstimator())
    fleet.apply(s, specs_from_settings(s, {}))
    next(iter(fleet)).health.record(True, 0.0)
    d = Dispatcher(
        fleet, make_policy("least_busy", affinity=True), queue_size=10, queue_timeout=1, clock=time.monotonic
    )
    facts = RequestFacts(model=None, prompt_tokens=3040, long=False, prefix_key=5, prefix_tokens=3000)
    leader = d.try_acquire(facts)
    follower = d.try_acquire(facts)
    assert leader is not None and follower is not None
    assert follower[1].work is not None and follower[1].work <= 48  # in flight: a hit, as on vLLM
    assert not next(iter(fleet)).cache.model.holds(5)
    leader[0].first_token()
    assert next(iter(fleet)).cache.model.holds(5)
    late = d.try_acquire(facts)
    assert late is not None and late[1].work is not None and late[1].work <= 48
    for lease, _ in (leader, follower, late):
        lease.release()


async def test_a_sheddable_request_is_refused_where_it_would_wait() -> None:
    _, d = one_slot_fleet(queue_timeout=5.0)
    got = d.try_acquire(FACTS)
    assert got is not None
    with pytest.raises(Overloaded) as shed:
        await d.wait_for_slot(FACTS, frozenset(), untimed, shed=True)
    assert shed.value.code == "shed" and shed.value.status == 429 and shed.value.retry_after
    assert d.queued == 0  # it never joined the queue
    got[0].release()


async def test_a_waiter_whose_instances_went_away_is_refused_at_once() -> None:
    """Behind a waiter that must wait, a waiter only a downed instance could take is refused (503)
    when capacity is looked at again, not left to its queue timeout."""
    s = Settings(
        instances=[
            InstanceSettings(url="http://127.0.0.1:9", name="a", max_queue=1),
            InstanceSettings(url="http://127.0.0.1:8", name="b", max_queue=1),
        ]
    )
    fleet = Fleet(s, SpeedEstimator())
    fleet.apply(s, specs_from_settings(s, {}))
    for inst, model in zip(fleet, ("A", "B"), strict=True):
        inst.health.record(True, 0.0)
        fleet.set_models(inst, {model: {"id": model}})
    d = Dispatcher(fleet, make_policy("least_busy"), queue_size=10, queue_timeout=30.0, clock=time.monotonic)
    wants_a, wants_b = (RequestFacts(model=m, prompt_tokens=10, long=False) for m in ("A", "B"))
    held = [d.try_acquire(wants_a), d.try_acquire(wants_b)]
    assert all(h is not None for h in held)
    first = asyncio.create_task(d.wait_for_slot(wants_a, frozenset(), untimed))
    second = asyncio.create_task(d.wait_for_slot(wants_b, frozenset(), untimed))
    await asyncio.sleep(0)
    b = fleet.get("b")
    while b.up:
        b.health.record(False, 1.0)
    d.recheck()
    with pytest.raises(NoInstance):
        await asyncio.wait_for(second, 1.0)
    assert not first.done() and d.queued == 1
    first.cancel()
    for h in held:
        assert h is not None
        h[0].release()


async def test_after_the_drain_began_nothing_more_is_sent_or_queued() -> None:
    """A request whose body ends once the drain's ``fail_all`` ran (or a retry out of its backoff)
    would be sent on a slot freed at the drain's end, on the closed upstream pool (a 502, not the
    shutdown's 503)."""
    fleet, d = one_slot_fleet(queue_timeout=5.0)
    got = d.try_acquire(FACTS)
    assert got is not None
    early = asyncio.create_task(d.wait_for_slot(FACTS, frozenset(), untimed))
    await asyncio.sleep(0)
    d.fail_all(NoInstance("The gateway is shutting down."))
    with pytest.raises(NoInstance, match="shutting down"):
        await early
    with pytest.raises(NoInstance, match="shutting down"):
        await d.wait_for_slot(FACTS, frozenset(), untimed)
    assert d.queued == 0
    got[0].release()
    with pytest.raises(NoInstance, match="shutting down"):  # a retry out of its backoff, a slot free
        d.try_acquire(FACTS)
    assert fleet.all_inflight() == 0
