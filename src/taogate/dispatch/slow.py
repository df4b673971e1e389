"""The slow-instance detector: which instances' learned prefill speed stays well below the fleet's.

A slow card (thermal throttling, a bad link, a noisy neighbour) made visible: ``Fleet.update_slow``
runs ``slow_instances`` over ``SpeedEstimator.snapshot()`` after each probe and scrape round;
``fleet.events.FleetEvents.check_slow`` logs and counts each change.

A card is flagged once its gap below the flag line, ``ln(ratio / relative)``, exceeds ``confidence``
times the error of its estimate: ``spread / sqrt(evidence)``, where the spread is at least ``noise``
and the evidence at most the EWMA's ``memory``. Dispatch starves a slow card of samples, so the
evidence needed shrinks as the gap grows; an EWMA never becomes surer than its memory, so a card
just under the line is left alone. The cases behind both rules: benchmarks/README.md, "Design notes
moved from the code". ``unsure_slow`` names the unflagged cards whose estimate leaves a doubt:
starved by dispatch, they may never gather the samples that would settle it (``control.remeasure``
asks).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Collection, Mapping
from dataclasses import dataclass

from .speed import ALPHA, SpeedStat

__all__ = ["SlowRule", "evidence_needed", "slow_instances", "unsure_slow"]


@dataclass(frozen=True, slots=True)
class SlowRule:
    """Flag below ``ratio`` × the others' median; clear only above ``recover_ratio`` (hysteresis)."""

    ratio: float = 0.6
    recover_ratio: float = 0.75
    min_evidence: float = 0.5  # full-size samples before an instance is judged or is a yardstick
    noise: float = 0.3  # least spread of one sample's log speed assumed (a real card's run-to-run noise)
    confidence: float = 2.0  # standard errors the gap below ``ratio`` must exceed
    memory: float = (2 - ALPHA) / ALPHA  # samples a learned speed's EWMA rests on


def evidence_needed(relative: float, rule: SlowRule = SlowRule(), spread: float = 0.0) -> float:
    """Full-size samples a card at ``relative`` × the others' speed needs before it is flagged, its
    samples straying ``spread`` from its estimate (at least ``rule.noise`` is assumed)."""
    if relative >= rule.ratio:
        return math.inf
    gap = math.log(rule.ratio / max(relative, 1e-9))
    return max(rule.min_evidence, (rule.confidence * max(rule.noise, spread) / gap) ** 2)


def _relative(stats: Mapping[str, SpeedStat], rule: SlowRule) -> dict[str, tuple[float, SpeedStat]]:
    """Each judged instance's speed over the median of the *other* judged ones (``min_evidence``
    each), so a slow one does not drag down its own yardstick (of two, each is compared with the
    other)."""
    known = {name: s for name, s in stats.items() if s.evidence >= rule.min_evidence and s.speed > 0}
    out: dict[str, tuple[float, SpeedStat]] = {}
    for name, stat in known.items():
        others = [s.speed for n, s in known.items() if n != name]
        if others:
            out[name] = (stat.speed / statistics.median(others), stat)
    return out


def slow_instances(
    stats: Mapping[str, SpeedStat], flagged: Collection[str] = frozenset(), rule: SlowRule = SlowRule()
) -> frozenset[str]:
    """The instances whose prefill speed stays well below the rest of the fleet's.

    ``flagged`` is the previous result: a flagged instance stays flagged until it recovers past
    ``recover_ratio``, so an estimate hovering near the threshold does not flap. A new flag needs the
    evidence of the module docstring.
    """
    out: set[str] = set()
    for name, (rel, stat) in _relative(stats, rule).items():
        if name in flagged:
            if rel < rule.recover_ratio:
                out.add(name)
        elif min(stat.evidence, max(rule.memory, rule.min_evidence)) >= evidence_needed(
            rel, rule, stat.spread
        ):
            out.add(name)
    return frozenset(out)


def unsure_slow(
    stats: Mapping[str, SpeedStat], flagged: Collection[str] = frozenset(), rule: SlowRule = SlowRule()
) -> dict[str, float]:
    """The unflagged instances whose estimate leaves a doubt, with their ratio to the others' median:
    under ``ratio`` on fewer samples than an estimate rests on (``memory``), or under
    ``recover_ratio`` with samples straying more than a real card's ``noise`` from it (a card seen
    turning slow). One steady on enough samples is not in doubt, just under the flag line (where no
    number of samples flags it) or between the lines. ``flagged``: ``slow_instances``' result."""
    settled = max(rule.memory, rule.min_evidence)
    return {
        name: rel
        for name, (rel, stat) in _relative(stats, rule).items()
        if name not in flagged
        and rel < rule.recover_ratio
        and (stat.spread > rule.noise or (rel < rule.ratio and stat.evidence < settled))
    }
