"""Sliding-window counters, the arithmetic: pure, and mirrored line for line by the Redis script.

A limit counts in fixed buckets of ``window`` ms; what was used "in the last window" is the previous
bucket's count, weighted by the share of it still inside the window, plus the current bucket's (a
sliding window counter: two numbers per limit, exact for a steady rate, and never more than one
bucket's count off). Counts kept in buckets of another length (``[limits] window`` reloaded) are
dropped: bucket numbers of two lengths do not compare. A request is admitted when one more request
and its reserved tokens fit both limits; its tokens are settled from usage later, in the bucket
that reserved them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["Counts", "State", "duration", "hit", "reset_after", "settle", "used", "wait_for"]


@dataclass(slots=True)
class State:
    """One key's counters: the current bucket's number, and requests and tokens in it and before it,
    in buckets of ``window_ms``."""

    bucket: int
    req_prev: int = 0
    req_cur: int = 0
    tok_prev: int = 0
    tok_cur: int = 0
    window_ms: int = 0

    def roll(self, bucket: int) -> None:
        """Move to ``bucket``: the current counts become the previous ones, or both go stale."""
        if bucket == self.bucket + 1:
            self.req_prev, self.tok_prev = self.req_cur, self.tok_cur
            self.req_cur = self.tok_cur = 0
        elif bucket > self.bucket + 1:
            self.req_prev = self.req_cur = self.tok_prev = self.tok_cur = 0
        self.bucket = max(bucket, self.bucket)  # a clock that stepped back keeps the later bucket


@dataclass(frozen=True, slots=True)
class Counts:
    """A check's outcome and the counters after it (what the rate-limit headers are made of)."""

    admitted: bool
    req_prev: int
    req_cur: int
    tok_prev: int
    tok_cur: int
    bucket: int  # where the tokens were reserved: settle there
    frac: float  # the share of the current bucket gone by
    busy: bool = False  # refused first: the key's requests in flight, all replicas', are at its max


def used(prev: float, cur: float, frac: float) -> float:
    return prev * (1.0 - frac) + cur


def hit(
    state: State | None, now_ms: int, window_ms: int, *, rpm: int, tpm: int, cost: int
) -> tuple[State, Counts]:
    """Count one request of ``cost`` tokens if it fits (``rpm``/``tpm`` 0: no such limit)."""
    bucket = now_ms // window_ms
    frac = (now_ms - bucket * window_ms) / window_ms
    if state is None or state.window_ms != window_ms:
        state = State(bucket, window_ms=window_ms)
    state.roll(bucket)
    ok = not (rpm > 0 and used(state.req_prev, state.req_cur, frac) + 1 > rpm) and not (
        tpm > 0 and used(state.tok_prev, state.tok_cur, frac) + cost > tpm
    )
    if ok:
        state.req_cur += 1
        state.tok_cur += cost
    counts = Counts(ok, state.req_prev, state.req_cur, state.tok_prev, state.tok_cur, state.bucket, frac)
    return state, counts


def settle(state: State, bucket: int, delta: int) -> None:
    """Correct the tokens reserved in ``bucket`` by ``delta`` (usage less the reservation), while
    that bucket still counts; never below zero."""
    if state.bucket == bucket:
        state.tok_cur = max(0, state.tok_cur + delta)
    elif state.bucket == bucket + 1:
        state.tok_prev = max(0, state.tok_prev + delta)


def wait_for(prev: int, cur: int, frac: float, window: float, *, limit: int, cost: int) -> float | None:
    """Seconds until ``cost`` more fits under ``limit`` with nothing else counted; None: never
    (``cost`` alone is over the limit)."""
    if cost > limit:
        return None
    room = limit - cost - cur
    if room >= 0:  # within the current bucket, as the previous one's weight runs out
        if prev <= room:
            return 0.0
        return max(0.0, 1.0 - room / prev - frac) * window
    rest = (1.0 - frac) * window  # then in the next, as this bucket's weight runs out
    return rest + max(0.0, 1.0 - (limit - cost) / cur) * window


def reset_after(prev: int, cur: int, frac: float, window: float) -> float:
    """Seconds until nothing counted now counts any more (OpenAI's ``x-ratelimit-reset-*``)."""
    if cur > 0:
        return (2.0 - frac) * window
    return (1.0 - frac) * window if prev > 0 else 0.0


def duration(seconds: float) -> str:
    """A duration as OpenAI's headers write one: ``20ms``, ``1.5s``, ``6m0s``."""
    ms = max(0, math.ceil(seconds * 1000))
    if ms < 1000:
        return f"{ms}ms"
    if round(seconds, 3) < 60.0:
        return f"{round(seconds, 3):g}s"
    minutes, rest = divmod(round(seconds), 60)  # rounded first: never "1m60s"
    return f"{minutes}m{rest}s"
