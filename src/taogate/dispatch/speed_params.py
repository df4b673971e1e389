"""What dispatch reads of each instance: its speed, fixed latency and decode pace, derived from
every instance's learned ``State`` at once (``SpeedEstimator`` keeps the states and calls
``derive`` after each change; O(n log n) in the fleet size).

* **Speed.** An instance without samples sits at its weight × the fleet's learned median per unit
  weight, not at a stale seed (a slow card with no first token yet would look the fastest and draw
  the burst). A speed learned from the gateway's timings alone is capped (``fast_cap``, see
  ``speed``). One with less than a full-size sample of evidence whose fixed latency is well above
  the others' is scaled down by that ratio (at most 4×, fading as evidence comes in): when all it
  gets are cache hits or short prompts, that is the only sign of a slow card, and a card whose
  every step is slower prefills slower. Never scaled up: a low base may just be a shorter path.
* **Fixed latency.** Until an instance has a few small samples of its own, it counts no higher than
  the fleet's: one stalled first answer must not make an instance look slow for good, since an
  instance dispatch avoids teaches nothing more.
* **Decode pace.** Until an instance has a decode sample: the fleet's median, scaled up (at most
  4×) by how much slower its prefill speed or fixed latency has shown it to be: a card whose every
  engine step is slower decodes slower too. Its first sample moves that pace (``SpeedEstimator``),
  not the configured prior.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from .speed_state import State

__all__ = ["MIN_BASE_SAMPLES", "Derived", "derive", "fleet_median"]

#: Small-work samples before an instance's fixed latency is compared with the others'.
MIN_BASE_SAMPLES = 3


@dataclass(frozen=True, slots=True)
class Derived:
    unit: float  # the fleet's learned median speed per unit weight
    speeds: dict[str, float]
    params: dict[str, tuple[float, float, float]]  # (speed, fixed latency, seconds per output token)


def fleet_median(
    states: Mapping[str, State], value: Callable[[State], float | None], default: float
) -> float:
    known = [v for v in map(value, states.values()) if v is not None]
    return statistics.median(known) if known else default


def _median_without(ordered: list[float], i: int) -> float:
    """Median of the sorted list ``ordered`` with its ``i``-th element left out (needs ≥ 2 elements)."""
    h = (len(ordered) - 1) // 2  # the middle of the m = len - 1 others (the upper one if m is even)
    upper = ordered[h] if h < i else ordered[h + 1]
    if len(ordered) % 2 == 0:  # m odd: one middle
        return upper
    return ((ordered[h - 1] if h - 1 < i else ordered[h]) + upper) / 2.0


def _dispatch_base(state: State, median: float) -> float:
    if state.base_n >= MIN_BASE_SAMPLES:
        return state.base
    return min(state.base, median) if state.base_n else median


def _median(ordered: list[float]) -> float:
    """``statistics.median`` of the sorted list ``ordered`` (not empty), float for float."""
    n = len(ordered)
    if n % 2:
        return ordered[n // 2]
    return (ordered[n // 2 - 1] + ordered[n // 2]) / 2


def _tpots(states: Mapping[str, State], speeds: Mapping[str, float], median: float) -> dict[str, float]:
    """Each instance's decode pace: its own once it has a sample, else the fleet's ``median``
    scaled up (at most 4x) by how much slower its speed or its fixed latency is than the others'
    medians (the module docstring). The others' medians come from one sorted list each, less the
    instance's own entry (``_median_without``): the same values as sorting the others anew."""
    rel = {n: speeds[n] / st.weight for n, st in states.items() if st.evidence > 0}
    rel_sorted = sorted(rel.values())
    based = {n: st.base for n, st in states.items() if st.base_n >= MIN_BASE_SAMPLES}
    based_sorted = sorted(based.values())
    out: dict[str, float] = {}
    for name, state in states.items():
        if state.tpot_n > 0:
            out[name] = state.tpot
            continue
        factor = 1.0
        own = rel.get(name)
        if own is not None and len(rel_sorted) > 1:
            others = _median_without(rel_sorted, rel_sorted.index(own))
            factor = others / max(speeds[name] / state.weight, 1e-9)
        n_others = len(based_sorted) - (1 if name in based else 0)
        if state.base_n >= MIN_BASE_SAMPLES and state.base > 0 and n_others > 0:
            factor = max(factor, state.base / _median_without(based_sorted, based_sorted.index(state.base)))
        out[name] = median * min(4.0, max(1.0, factor))
    return out


def derive(
    states: Mapping[str, State], *, nominal: float, fast_cap: float, base_prior: float, tpot_prior: float
) -> Derived:
    """Every instance's dispatch parameters, as the module docstring says. It runs after every
    change (at most every few milliseconds), so each median is of one sorted list; a property
    test holds it equal, float for float, to the formulation with a median per instance."""
    bases = {n: st.base for n, st in states.items() if st.base_n >= MIN_BASE_SAMPLES and st.base > 0}
    learned = sorted(
        (math.exp(st.log_speed) / st.weight, name) for name, st in states.items() if st.evidence > 0
    )
    values = [v for v, _ in learned]
    unit = _median(values) if values else nominal
    speeds = {name: st.weight * unit for name, st in states.items()}
    for i, (value, name) in enumerate(learned):
        state = states[name]
        capped = len(values) > 1 and state.guessed and not state.engine
        cap = fast_cap * _median_without(values, i) if capped else math.inf
        speeds[name] = state.weight * min(value, cap)
    if len(bases) > 1:
        bases_sorted = sorted(bases.values())
        for name, st in states.items():
            own = bases.get(name)
            if st.evidence < 1.0 and own is not None:
                others = _median_without(bases_sorted, bases_sorted.index(own))
                factor = min(1.0, max(0.25, others / own))
                speeds[name] *= factor ** (1.0 - st.evidence)
    known_bases = sorted(st.base for st in states.values() if st.base_n > 0)
    base_median = _median(known_bases) if known_bases else base_prior
    known_tpots = sorted(st.tpot for st in states.values() if st.tpot_n > 0)
    tpot_median = _median(known_tpots) if known_tpots else tpot_prior
    tpots = _tpots(states, speeds, tpot_median)
    params = {
        name: (speeds[name], _dispatch_base(st, base_median), tpots[name]) for name, st in states.items()
    }
    return Derived(unit, speeds, params)
