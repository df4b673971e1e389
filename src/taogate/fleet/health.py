"""Per-instance health from active probes: a pure state machine (the probe loop is ``control.probes``).

::

    UNKNOWN → UP     on its first good probe
    UP → DOWN        after ``unhealthy_after`` bad probes in a row
    DOWN → UP        after ``healthy_after`` good probes in a row
    UNKNOWN → DOWN   after ``unhealthy_after`` bad probes (for logs and metrics)

Only UP takes traffic: vLLM takes minutes to load a model, so an instance that never passed a probe
would only collect connection errors; when none is UP the gateway answers 503 at once. ``record``
returns a ``Transition`` only when the state changes, so each is logged once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum

__all__ = ["HealthState", "HealthTracker", "Transition", "probe_result"]


class HealthState(StrEnum):
    UNKNOWN = "unknown"
    UP = "up"
    DOWN = "down"


@dataclass(frozen=True, slots=True)
class Transition:
    """One state change, for one log line and one metric update."""

    from_: HealthState
    to: HealthState
    at: float  # monotonic seconds
    streak: int  # consecutive probe results that caused it
    since: float  # when ``from_`` began (so ``at - since`` is how long it lasted)


def probe_result(result: int | BaseException) -> bool:
    """A probe passed: its HTTP status was 2xx. Any exception (refused, timeout, reset) is a failure.

    vLLM answers /health with 200 once the engine is ready and with 5xx (or not at all) while loading
    or after the engine died, so a non-2xx status is a failure, not a "maybe".
    """
    if isinstance(result, BaseException):
        return False
    return 200 <= result < 300


class HealthTracker:
    """Counts consecutive probe results and turns them into UP/DOWN with hysteresis."""

    __slots__ = ("_bad", "_good", "_on_move", "_since", "_state", "healthy_after", "unhealthy_after")

    def __init__(
        self,
        unhealthy_after: int,
        healthy_after: int,
        now: float = 0.0,
        *,
        on_move: Callable[[], None] | None = None,
    ) -> None:
        """``on_move`` is called after each change of state (its instance's dispatch view shows it)."""
        self._on_move = on_move
        self.unhealthy_after = self.healthy_after = 1
        self.reconfigure(unhealthy_after, healthy_after)
        self._state = HealthState.UNKNOWN
        self._since = now
        self._good = 0
        self._bad = 0

    def reconfigure(self, unhealthy_after: int, healthy_after: int) -> None:
        """New thresholds from a config reload; state and streaks carry over, the next probe applies them."""
        if unhealthy_after < 1 or healthy_after < 1:
            raise ValueError("unhealthy_after and healthy_after must be at least 1")
        self.unhealthy_after = unhealthy_after
        self.healthy_after = healthy_after

    @property
    def state(self) -> HealthState:
        return self._state

    @property
    def since(self) -> float:
        """When the current state began (monotonic seconds)."""
        return self._since

    @property
    def eligible(self) -> bool:
        """May receive traffic: only UP (see the module docstring for why not UNKNOWN)."""
        return self._state is HealthState.UP

    @property
    def consecutive_ok(self) -> int:
        return self._good

    @property
    def consecutive_failures(self) -> int:
        return self._bad

    def record(self, ok: bool, now: float) -> Transition | None:
        """Account one probe result; return the transition it caused, if any."""
        if ok:
            self._good += 1
            self._bad = 0
            needed = 1 if self._state is HealthState.UNKNOWN else self.healthy_after
            if self._state is not HealthState.UP and self._good >= needed:
                return self._move(HealthState.UP, now, self._good)
        else:
            self._bad += 1
            self._good = 0
            if self._state is not HealthState.DOWN and self._bad >= self.unhealthy_after:
                return self._move(HealthState.DOWN, now, self._bad)
        return None

    def _move(self, to: HealthState, now: float, streak: int) -> Transition:
        transition = Transition(self._state, to, now, streak, self._since)
        self._state = to
        self._since = now
        if self._on_move is not None:
            self._on_move()
        return transition
