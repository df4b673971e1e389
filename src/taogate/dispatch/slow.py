"""The slow-instance detector: which instances' learned prefill speed stays well below the fleet's.

A slow card (thermal throttling, a bad link, a noisy neighbour) made visible: ``Fleet.update_slow``
runs ``slow_instances`` over ``SpeedEstimator.snapshot()`` after each probe and scrape round;
``control.events.FleetEvents.check_slow`` logs and counts each change, ``taogate_instance_slow`` and
``taogate status`` show it.
"""

from __future__ import annotations

import statistics
from collections.abc import Collection, Mapping
from dataclasses import dataclass

from .speed import SpeedStat

__all__ = ["SlowRule", "slow_instances"]


@dataclass(frozen=True, slots=True)
class SlowRule:
    """Flag below ``ratio`` × the others' median; clear only above ``recover_ratio`` (hysteresis)."""

    ratio: float = 0.6
    recover_ratio: float = 0.75
    min_evidence: float = 8.0  # full-size samples (see ``SpeedStat.evidence``) before judging


def slow_instances(
    stats: Mapping[str, SpeedStat], flagged: Collection[str] = frozenset(), rule: SlowRule = SlowRule()
) -> frozenset[str]:
    """The instances whose prefill speed stays well below the rest of the fleet's.

    Each instance is compared with the median of the *other* instances that have enough samples, so a
    slow one does not drag down its own yardstick (with two instances, each is compared with the other).
    ``flagged`` is the previous result: a flagged instance stays flagged until it recovers past
    ``recover_ratio``, so an estimate hovering near the threshold does not flap. Instances with less
    than ``min_evidence`` (tiny requests count for little) are neither flagged nor used as yardstick:
    an estimate still near its seed says nothing about the card.
    """
    known = {name: s.speed for name, s in stats.items() if s.evidence >= rule.min_evidence and s.speed > 0}
    out: set[str] = set()
    for name, speed in known.items():
        others = [v for n, v in known.items() if n != name]
        if not others:
            continue
        rel = speed / statistics.median(others)
        limit = rule.recover_ratio if name in flagged else rule.ratio
        if rel < limit:
            out.add(name)
    return frozenset(out)
