"""Failover policy, all pure: what is retryable, how long to back off, and the retry budget.

::

    attempt failed ──► Failure ──► judge(failure, instance, room) ──► Judgement
        room: attempts left, another instance could take it, the budget has room, the body
              can be sent again (a streamed upload only before it started)
                                        │ blame ──► FleetEvents.request_failed (its breaker)
        RETRY ──► spend the budget, sleep backoff(n, base, cap, rand), another eligible instance
        RELAY ──► the instance's own answer (a status) goes to the client as it is
        ANSWER ─► the gateway's own error (502, 503 or 504 in the route's shape)

Retry only what is the *instance's* problem and only while nothing has gone downstream: once the
client has a status line or a byte of the body, a retry would splice two answers together. 4xx is the
client's problem and fails the same everywhere (408 and 429 are the exceptions: the instance timed
out or is overloaded, another one may not be). vLLM answers 500 for engine errors that are local to
that instance (a crashed engine core, CUDA errors), so 500 is retried like 502/503/504.

The budget caps retries at a fraction of recent requests: when the whole fleet is sick, retries
would multiply load exactly when there is least capacity (a retry storm), so past the budget a failure
goes back to the client instead.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum

from taogate.errors import GatewayError, NoInstance, UpstreamError, UpstreamTimeout

__all__ = [
    "AttemptFailure",
    "Failure",
    "FailureKind",
    "Judgement",
    "Next",
    "RetryBudget",
    "Verdict",
    "answer",
    "backoff",
    "classify",
    "judge",
]


def backoff(attempt: int, base: float, cap: float, rand: float) -> float:
    """Seconds to wait before retry number ``attempt`` (1 = the first retry), ``rand`` in [0, 1).

    The ceiling doubles per attempt from ``base`` up to ``cap``. Equal jitter waits between half the
    ceiling and the ceiling: jitter still spreads simultaneous retries apart, but a retry is never
    near-immediate, which matters because each retry of a long prompt is a full prefill somewhere
    else and aggressive retries deepen the very queues that caused the failure.
    """
    if attempt < 1:
        raise ValueError(f"attempt must be >= 1, got {attempt}")
    if not 0.0 <= rand < 1.0:
        raise ValueError(f"rand must be in [0, 1), got {rand}")
    if base <= 0 or cap <= 0:
        return 0.0
    # The exponent is clamped so that 2.0 ** n cannot raise OverflowError for absurd attempt numbers.
    ceiling = min(cap, base * 2.0 ** min(attempt - 1, 1000))
    return ceiling / 2 + rand * ceiling / 2


class FailureKind(StrEnum):
    """How an attempt failed, as the proxy sees it (``proxy.upstream.failure_of`` maps the hop's errors)."""

    CONNECT = "connect"  # refused, reset or DNS failure while connecting: nothing was processed
    CONNECT_TIMEOUT = "connect_timeout"
    CLOSED = "closed"  # the instance closed the connection before the answer was in (crash, restart)
    READ_TIMEOUT = "read_timeout"  # a read or write stalled past its timeout (hung engine)
    POOL_TIMEOUT = "pool_timeout"  # our own connection pool was exhausted: not the instance's fault
    STATUS = "status"  # the instance answered with an HTTP status (see ``status``)


_RETRYABLE_STATUS = frozenset({408, 429, 500, 502, 503, 504})
_FAULT_STATUS = frozenset({500, 502, 503, 504})
_RETRYABLE_KIND = frozenset(
    {
        FailureKind.CONNECT,
        FailureKind.CONNECT_TIMEOUT,
        FailureKind.CLOSED,
        FailureKind.READ_TIMEOUT,
    }
)


@dataclass(frozen=True, slots=True)
class Verdict:
    """What one failed attempt means.

    ``retry``: worth trying on *another* instance (if attempts and budget allow).
    ``instance_fault``: counts against the instance's circuit breaker.
    ``reason``: bounded, usable as a metric label.
    """

    retry: bool
    instance_fault: bool
    reason: str


def classify(kind: FailureKind, *, status: int | None = None) -> Verdict:
    """Classify an attempt that failed before anything went downstream (after that, the pipeline
    retries nothing: a stream that breaks is ended with an error event and blames the instance)."""
    if kind is FailureKind.STATUS:
        if status is None:
            raise ValueError("FailureKind.STATUS needs a status")
        fault = status in _FAULT_STATUS
        retry = status in _RETRYABLE_STATUS
        known = status in _RETRYABLE_STATUS
        return Verdict(retry, fault, f"status_{status}" if known else f"status_{status // 100}xx")
    # Our own pool running dry says nothing about the instance; retrying would hit the same pool.
    # A connection closed before the answer is mostly the keep-alive race (a pooled connection the
    # server closed while we picked it: under load thousands at once, which would eject a healthy
    # fleet); an instance that really died refuses new connections (CONNECT) and fails its probes.
    fault = kind not in (FailureKind.POOL_TIMEOUT, FailureKind.CLOSED)
    retry = kind in _RETRYABLE_KIND
    return Verdict(retry, fault, kind.value)


@dataclass(frozen=True, slots=True)
class Failure:
    """One failed attempt: how, in a few words, and for ``STATUS`` the instance's status.
    ``malformed``: the answer broke the protocol or a limit, which counts against the instance even
    where a closed connection would not."""

    kind: FailureKind
    detail: str
    status: int | None = None
    malformed: bool = False


class Next(StrEnum):
    """What the pipeline does after a failed attempt."""

    RETRY = "retry"  # another instance
    RELAY = "relay"  # the instance's own answer goes to the client as it is
    ANSWER = "answer"  # the gateway's own error (``Judgement.error``)


class AttemptFailure(Exception):
    """An attempt failed before any byte went downstream, and a retry elsewhere was granted."""

    def __init__(self, reason: str, instance: str, detail: str, blame: bool = True) -> None:
        super().__init__(reason, instance, detail)
        self.reason = reason  # bounded (``classify``): connect, closed, read_timeout, status_503, ...
        self.instance = instance
        self.detail = detail
        self.blame = blame  # the instance's fault (not a 429, a timeout of ours, a closed keep-alive)


@dataclass(frozen=True, slots=True)
class Judgement:
    """What follows a failed attempt (``judge``)."""

    next: Next  # RETRY or ANSWER for a failed hop, RETRY or RELAY for a status
    blame: bool  # counts against the instance's circuit breaker
    reason: str  # bounded: a metric label and the access log's error
    denied: bool  # worth a retry, but there was no room for one
    failure: Failure
    instance: str

    def exception(self) -> Exception:
        """What ends the attempt: ``AttemptFailure`` for a retry, else the gateway's own error."""
        if self.next is Next.RETRY:
            return AttemptFailure(self.reason, self.instance, self.failure.detail, self.blame)
        return answer(self.failure, self.instance)


def judge(failure: Failure, instance: str, room: bool) -> Judgement:
    """What a failed attempt means and what follows it; ``room``: another attempt may be made
    (attempts left, another instance could take the request, the retry budget has room)."""
    verdict = classify(failure.kind, status=failure.status)
    blame = verdict.instance_fault or failure.malformed
    if verdict.retry and room:
        then, denied = Next.RETRY, False
    else:
        then = Next.RELAY if failure.kind is FailureKind.STATUS else Next.ANSWER
        denied = verdict.retry
    return Judgement(then, blame, verdict.reason, denied, failure, instance)


def answer(failure: Failure, instance: str) -> GatewayError:
    """The gateway's own answer for an attempt that failed (the route gives it its shape)."""
    if failure.kind is FailureKind.POOL_TIMEOUT:
        return NoInstance(
            f"The gateway's upstream connection pool is exhausted ({failure.detail}); raise "
            "[gateway] max_connections to at least the sum of the instances' max_queue.",
            retry_after=1,
        )
    if failure.kind in (FailureKind.CONNECT_TIMEOUT, FailureKind.READ_TIMEOUT):
        return UpstreamTimeout(
            f"Instance {instance} did not answer in time ({failure.detail}). Long prefills need a "
            "generous [gateway] request_timeout (120 s or more).",
        )
    return UpstreamError(f"Instance {instance} failed: {failure.detail}.")


class RetryBudget:
    """Retries allowed while ``retries ≤ ratio × requests + min_per_window`` over a sliding window.

    The window is ``buckets`` fixed slices of ``window / buckets`` seconds; counts live per slice, so
    memory is O(buckets) whatever the traffic (no list of timestamps). The window therefore slides
    in slice-sized steps: it covers between ``(buckets - 1) / buckets`` of ``window`` and all of it.
    ``min_per_window`` lets a quiet gateway still retry (one request at ratio 0.2 earns 0.2 retries).

    Call ``record_request`` once per client request (not per attempt), ``try_spend`` before each
    retry; a refused ``try_spend`` consumes nothing.
    """

    __slots__ = ("_idx", "_min", "_ratio", "_requests", "_retries", "_width")

    def __init__(self, ratio: float, min_per_window: int, window: float, buckets: int = 10) -> None:
        if ratio < 0 or min_per_window < 0 or window <= 0 or buckets < 1:
            raise ValueError("ratio and min_per_window must be >= 0, window > 0, buckets >= 1")
        self._ratio = ratio
        self._min = min_per_window
        self._width = window / buckets
        self._idx = [-1] * buckets  # absolute slice number each ring slot currently holds
        self._requests = [0] * buckets
        self._retries = [0] * buckets

    @property
    def ratio(self) -> float:
        return self._ratio

    def reloaded(self, ratio: float) -> RetryBudget:
        """A budget at ``ratio`` over this one's window: the counts are shared, not copied, so the
        requests still in flight under the old config count in the same window as the new ones."""
        new = RetryBudget(ratio, self._min, self._width * len(self._idx), len(self._idx))
        new._idx, new._requests, new._retries = self._idx, self._requests, self._retries
        return new

    def record_request(self, now: float) -> None:
        self._requests[self._slot(now)] += 1

    def has_room(self, now: float) -> bool:
        """Whether ``try_spend`` would succeed now (nothing taken)."""
        requests, retries = self.counts(now)
        return retries + 1 <= self._ratio * requests + self._min

    def try_spend(self, now: float) -> bool:
        """Take one retry from the budget if it has room; False (and no change) otherwise."""
        slot = self._slot(now)
        requests, retries = self.counts(now)
        if retries + 1 > self._ratio * requests + self._min:
            return False
        self._retries[slot] += 1
        return True

    def counts(self, now: float) -> tuple[int, int]:
        """(requests, retries) in the window ending now (for metrics and tests)."""
        current = self._absolute(now)
        live = [i for i, idx in enumerate(self._idx) if current - len(self._idx) < idx <= current]
        return sum(self._requests[i] for i in live), sum(self._retries[i] for i in live)

    def _absolute(self, now: float) -> int:
        return math.floor(now / self._width)

    def _slot(self, now: float) -> int:
        absolute = self._absolute(now)
        slot = absolute % len(self._idx)
        if self._idx[slot] < absolute:  # the slot held an older slice: recycle it
            self._idx[slot] = absolute
            self._requests[slot] = 0
            self._retries[slot] = 0
        # A clock that went backwards (not monotonic) lands in a newer slice's slot: count it there.
        return slot
