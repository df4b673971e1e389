"""Fleet events: the one owner of instance state changes the operator must hear about.

The request path (a request failed or succeeded on an instance) and the probes (health, slow cards)
both report here. Each change is logged once and counted once (``taogate_health_transitions``; of
a breaker trial, its verdict, not its start), and the gateway queue is woken whenever capacity may
have appeared, so no caller repeats that logic.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Protocol

from taogate.fleet.breaker import BreakerTransition
from taogate.fleet.dispatcher import Dispatcher
from taogate.fleet.fleet import Fleet
from taogate.fleet.health import HealthState, Transition
from taogate.fleet.instance import Instance

__all__ = ["FleetEvents", "TransitionCounter"]

log = logging.getLogger("taogate.health")


class TransitionCounter(Protocol):
    """Where each change is counted (the gateway's metrics)."""

    def count_transition(self, instance: str, kind: str, to: str) -> None: ...


class FleetEvents:
    def __init__(
        self,
        fleet: Fleet,
        dispatcher: Dispatcher,
        metrics: TransitionCounter,
        *,
        clock: Callable[[], float],
    ) -> None:
        self._fleet = fleet
        self._dispatcher = dispatcher
        self._metrics = metrics
        self._clock = clock

    def _count(self, name: str, kind: str, to: str) -> None:
        self._metrics.count_transition(name, kind, to)

    # -- the request path -----------------------------------------------------------------------
    def request_failed(self, inst: Instance) -> None:
        """A request failed through the instance's fault: it counts against its breaker."""
        transition = inst.breaker.record_failure(self._clock())
        if transition is not None:
            self.breaker_changed(inst, transition)

    def request_succeeded(self, inst: Instance) -> None:
        transition = inst.breaker.record_success(self._clock())
        if transition is not None:
            self.breaker_changed(inst, transition)

    def breaker_changed(self, inst: Instance, transition: BreakerTransition) -> None:
        to = transition.to.value
        self._count(inst.name, "breaker", to)
        if to == "open":
            cooldown = transition.cooldown  # doubled after each failed trial
            log.warning("instance %s ejected for %.0fs after repeated request failures", inst.name, cooldown)
            # The queue is woken when the trial becomes possible: nothing else happens then.
            asyncio.get_running_loop().call_later(cooldown + 0.01, self._dispatcher.pump)
            self._dispatcher.recheck()  # waiters only it could take are refused now
        else:
            log.info("instance %s breaker %s", inst.name, to)
            self._dispatcher.pump()

    # -- the probes -----------------------------------------------------------------------------
    def health_changed(self, inst: Instance, transition: Transition, detail: str) -> None:
        self._count(inst.name, "health", transition.to.value)
        if transition.to is HealthState.UP:
            models = sorted(inst.models) or "?"
            log.info("instance %s is up (%s); serving %s", inst.name, inst.spec.url, models)
        else:
            log.warning("instance %s is %s: %s", inst.name, transition.to.value, detail)

    def remeasured(self, inst: Instance, idle_for: float, unsure: float | None = None) -> None:
        """An instance that reads slow and taught nothing for ``idle_for`` s is measured again:
        flagged, or ``unsure`` (its speed's ratio to the fleet's, on an estimate in doubt)."""
        if unsure is None:
            why = "is flagged slow"
        else:
            why = f"reads {unsure:.2f}x the fleet's prefill speed on samples too few or scattered to be sure"
        log.info(
            "instance %s %s and has taught dispatch nothing for %g s: measuring it again",
            inst.name,
            why,
            idle_for,
        )
        self._count(inst.name, "speed", "remeasured")

    def capacity_changed(self) -> None:
        """Capacity may have changed (an instance came up or went down, a cool-down ended)."""
        self._dispatcher.recheck()

    def check_slow(self) -> None:
        """Run the slow-instance detector; one log line per change, not per check."""
        fleet = self._fleet
        flagged, cleared = fleet.update_slow()
        for name in sorted(flagged):
            log.warning(
                "instance %s is slow: its prefill speed is %.2fx the fleet median whatever the dispatch; "
                "look inside it (AllReduce, host-device copies)",
                name,
                fleet.speeds.relative(name),
            )
            self._count(name, "slow", "slow")
        for name in sorted(cleared):
            log.info("instance %s is no longer slow (%.2fx the median)", name, fleet.speeds.relative(name))
            self._count(name, "slow", "ok")
