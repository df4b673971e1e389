"""Measure a card that reads slow again once it has taught dispatch nothing for a while.

Dispatch sends a slow card little or nothing, so its learned speed stops moving: a card misread as
slow (a stall during its warm-up, a neighbour since gone) would stay flagged and idle for ever, and
one turned slow whose few samples do not yet make the detector sure would never be flagged. A card
flagged slow, or unflagged on an estimate that leaves a doubt (``dispatch.slow.unsure_slow``), up,
neither draining nor overflow, with none of our requests in flight, whose speed has taken no
sample for ``[dispatch] remeasure_after`` seconds, gets the warm-up's prompts again. A flagged
card's estimate is that old, so their answers replace it (a card misread as slow is cleared by one
re-measure); an unsure one's answers add to its evidence, which is what it lacks. The slow-instance
detector then runs on the result.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Collection, Mapping
from typing import Protocol

from taogate.fleet.events import FleetEvents
from taogate.fleet.fleet import Fleet
from taogate.fleet.health import HealthState
from taogate.fleet.instance import Instance
from taogate.settings import Settings

__all__ = ["Remeasure", "due"]

#: Per instance: its speed's sample count when last seen to change, and when that was.
Seen = dict[str, tuple[int, float]]


class Measure(Protocol):
    """The warm-up's measurement (``Warmup.measure``): False when it taught nothing."""

    def __call__(self, inst: Instance, *, afresh: bool) -> Awaitable[bool]: ...


def due(
    candidates: Collection[str],
    idle: Collection[str],
    samples: Mapping[str, int],
    seen: Mapping[str, tuple[int, float]],
    *,
    now: float,
    after: float,
) -> tuple[list[str], Seen]:
    """Which of the ``candidates`` (the cards reading slow) are idle and have taught nothing for
    ``after`` seconds (0: none ever), and what is seen now. An instance's clock restarts whenever its
    sample count moves; one no longer a candidate is forgotten."""
    fresh: Seen = {}
    out: list[str] = []
    for name in candidates:
        count = samples.get(name, 0)
        last = seen.get(name)
        if last is None or last[0] != count:
            fresh[name] = (count, now)
            continue
        fresh[name] = last
        if after > 0 and name in idle and now - last[1] >= after:
            out.append(name)
    return sorted(out), fresh


class Remeasure:
    """The round that measures starved cards that read slow again (every health-check interval)."""

    def __init__(
        self,
        fleet: Fleet,
        measure: Measure,
        settings: Callable[[], Settings],
        events: FleetEvents,
        *,
        clock: Callable[[], float],
    ) -> None:
        self._fleet = fleet
        self._measure = measure
        self._settings = settings
        self._events = events
        self._clock = clock
        self._seen: Seen = {}

    async def __call__(self) -> None:
        fleet = self._fleet
        by_name = {i.name: i for i in fleet}
        idle = {
            i.name
            for i in by_name.values()
            if i.health.state is HealthState.UP and i.inflight == 0 and not i.draining and not i.spec.overflow
        }
        flagged, unsure = fleet.slow, fleet.unsure_slow()
        candidates = flagged | unsure.keys()
        samples = {name: fleet.speeds.samples(name) for name in candidates}
        after = self._settings().dispatch.remeasure_after
        names, self._seen = due(candidates, idle, samples, self._seen, now=self._clock(), after=after)
        measured = False
        for name in names:
            inst = by_name.get(name)
            if inst is None:
                continue
            self._events.remeasured(inst, after, unsure.get(name))
            measured |= await self._measure(inst, afresh=name in flagged)
            # Its clock restarts now, whether or not the prompts taught anything.
            self._seen[name] = (fleet.speeds.samples(name), self._clock())
        if measured:
            self._events.check_slow()
