"""When a stream's TTFT may hold a wait for a batch slot: the engine has a queue while all it runs
are past their prefill."""

from __future__ import annotations

from taogate.fleet.engine import EngineSample
from taogate.fleet.instance import Instance, InstanceSpec
from taogate.fleet.learning import waiting_for_slots


def _instance(running: float, waiting: float, *, inflight: int, prefilling: int) -> Instance:
    inst = Instance(
        InstanceSpec("a", "http://a"),
        unhealthy_after=2,
        healthy_after=1,
        breaker_failures=5,
        breaker_cooldown=1,
    )
    inst.record_scrape(EngineSample(running=running, waiting=waiting), now=10.0)
    inst.inflight, inst.prefilling = inflight, prefilling
    return inst


def _waits(inst: Instance, now: float) -> bool:
    return waiting_for_slots(inst, inst.engine_stats(now))


def test_a_queue_behind_decodes_is_a_wait_for_slots() -> None:
    # Two slots, both decoding ours; two more of ours wait: their TTFT holds the decodes' time.
    assert _waits(_instance(2, 2, inflight=4, prefilling=2), 10.5)


def test_a_queue_behind_a_prefill_is_booked_work() -> None:
    # One long prompt prefilling takes the step's token budget: the wait is booked work.
    assert not _waits(_instance(1, 3, inflight=4, prefilling=4), 10.5)
    assert not _waits(_instance(2, 0, inflight=2, prefilling=0), 10.5)  # no queue
    assert not _waits(_instance(2, 2, inflight=4, prefilling=2), 30.0)  # stale stats
