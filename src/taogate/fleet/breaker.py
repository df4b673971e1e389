"""Circuit breaker on the requests themselves: a pure state machine with an injected clock.

A vLLM engine can hang (or fail every request) while /health still answers 200, so the verdicts of
real requests count too: ``failures`` in a row open the breaker for a cooldown (doubling up to
``max_cooldown`` while trials fail); then one trial request is let through (HALF_OPEN), and its
verdict closes or reopens it. Verdicts of requests sent before the trip are ignored while OPEN.

Per request: ``allows(now)`` while building the dispatch snapshot, ``trial = on_dispatch(now)`` when
it is really sent, ``record_success``/``record_failure`` for its verdict and, for the trial,
``release_trial()`` when it ends (which frees the slot when the client left without a verdict).
Each transition is returned once by the call that caused it, except the trial's start (OPEN →
HALF_OPEN, made by ``on_dispatch`` as it sends the trial): only its verdict's is. The state
diagram and the reasoning on stragglers: benchmarks/README.md, "Design notes moved from the code".
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum

__all__ = ["Breaker", "BreakerState", "BreakerTransition"]


class BreakerState(StrEnum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


@dataclass(frozen=True, slots=True)
class BreakerTransition:
    from_: BreakerState
    to: BreakerState
    at: float  # monotonic seconds
    cooldown: float  # the cooldown now in force (what OPEN waits before the next trial)


class Breaker:
    """Per-instance breaker; see the module docstring for the state diagram and caller protocol."""

    __slots__ = (
        "_base",
        "_cooldown",
        "_failures",
        "_max_cooldown",
        "_on_move",
        "_opened_at",
        "_state",
        "_streak",
        "_trial",
    )

    def __init__(
        self,
        failures: int,
        cooldown: float,
        max_cooldown: float | None = None,
        *,
        on_move: Callable[[], None] | None = None,
    ) -> None:
        """``max_cooldown``: each failed trial doubles the cooldown up to this (``None``: no growth).

        Growth keeps a persistently broken instance from getting a (slow, failing) trial request
        every ``cooldown`` seconds forever; the cap bounds how long a recovered instance sits idle.
        ``on_move`` is called after each change of state (its instance's dispatch view shows it).
        """
        self._on_move = on_move
        self._state = BreakerState.CLOSED
        self._opened_at = 0.0
        self._streak = 0  # consecutive failures while CLOSED
        self._trial = False  # the HALF_OPEN trial is in flight
        self._failures = failures
        self._base = self._max_cooldown = self._cooldown = cooldown
        self.reconfigure(failures, cooldown, max_cooldown)

    def reconfigure(self, failures: int, cooldown: float, max_cooldown: float | None = None) -> None:
        """New thresholds from a config reload; the current state stays, and a cooldown in force
        is kept within the new bounds."""
        if failures < 1:
            raise ValueError("failures must be at least 1")
        if cooldown <= 0:
            raise ValueError("cooldown must be positive")
        self._failures = failures
        self._base = cooldown
        self._max_cooldown = cooldown if max_cooldown is None else max(cooldown, max_cooldown)
        if self._state is BreakerState.CLOSED:
            self._cooldown = cooldown
        else:
            self._cooldown = min(max(self._cooldown, cooldown), self._max_cooldown)

    # -- read-only views -------------------------------------------------------------------------

    def state(self, now: float) -> BreakerState:
        if self._state is BreakerState.OPEN and now >= self._opened_at + self._cooldown:
            return BreakerState.HALF_OPEN
        return self._state

    @property
    def closed(self) -> bool:
        """CLOSED: every request is let through, whatever the time."""
        return self._state is BreakerState.CLOSED

    def allows(self, now: float) -> bool:
        """Would a request be let through now? Claims nothing."""
        if self._state is BreakerState.CLOSED:
            return True
        state = self.state(now)
        if state is BreakerState.CLOSED:
            return True
        return state is BreakerState.HALF_OPEN and not self._trial

    @property
    def consecutive_failures(self) -> int:
        return self._streak

    @property
    def cooldown(self) -> float:
        return self._cooldown

    @property
    def trial_in_flight(self) -> bool:
        return self._trial

    def retry_at(self) -> float | None:
        """When an OPEN breaker will admit a trial (for Retry-After estimates); ``None`` if not OPEN."""
        return self._opened_at + self._cooldown if self._state is BreakerState.OPEN else None

    # -- mutations -------------------------------------------------------------------------------

    def on_dispatch(self, now: float) -> bool:
        """A request is being sent; True when it is the half-open trial (it then owns the slot).

        Call it only when ``allows(now)`` said yes in the same synchronous step; a dispatch the breaker
        would refuse goes through as an ordinary request (never a second trial) rather than failing.
        """
        if self._state is BreakerState.CLOSED or not self.allows(now):
            return False
        if self._state is BreakerState.OPEN:
            self._move(BreakerState.HALF_OPEN, now)
        self._trial = True
        return True

    def record_success(self, now: float) -> BreakerTransition | None:
        if self._state is BreakerState.CLOSED:
            self._streak = 0
            return None
        if self._state is BreakerState.HALF_OPEN:
            self._trial = False
            self._streak = 0
            self._cooldown = self._base
            return self._move(BreakerState.CLOSED, now)
        return None  # OPEN: a straggler sent before the trip; the trial will decide

    def record_failure(self, now: float) -> BreakerTransition | None:
        if self._state is BreakerState.CLOSED:
            self._streak += 1
            return self._open(now) if self._streak >= self._failures else None
        if self._state is BreakerState.HALF_OPEN:
            self._trial = False
            self._cooldown = min(self._cooldown * 2, self._max_cooldown)
            return self._open(now)
        return None  # OPEN: a straggler; counting it would only extend an ejection already decided

    def release_trial(self) -> None:
        """The trial request ended: free its slot (a no-op if a verdict already did)."""
        if self._state is BreakerState.HALF_OPEN:
            self._trial = False

    def reset(self, now: float) -> BreakerTransition | None:
        """Force CLOSED (an operator re-enabled the instance, or it restarted and passed its probes)."""
        self._streak = 0
        self._trial = False
        self._cooldown = self._base
        return self._move(BreakerState.CLOSED, now) if self._state is not BreakerState.CLOSED else None

    # -- internals -------------------------------------------------------------------------------

    def _open(self, now: float) -> BreakerTransition:
        self._opened_at = now
        return self._move(BreakerState.OPEN, now)

    def _move(self, to: BreakerState, now: float) -> BreakerTransition:
        transition = BreakerTransition(self._state, to, now, self._cooldown)
        self._state = to
        if self._on_move is not None:
            self._on_move()
        return transition
