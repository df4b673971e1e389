"""The stream guard: ends a stream whose instance stopped sending events, whose client stopped
reading, or that has lasted too long.

Built to cost next to nothing per relayed chunk: one clock read around each send, and a single
timer that re-arms itself instead of being rescheduled per chunk.
"""

from __future__ import annotations

import asyncio
import math

__all__ = ["IdleGuard"]


class IdleGuard:
    """Ends a stream that stopped moving: cancels the relaying task when the instance has completed
    no event for ``idle`` seconds (``expired``: bytes alone do not count, or one byte every few
    seconds would hold the instance slot for ever), when one send to the client has been blocked
    for ``stall`` seconds (``stalled``: a client that keeps its connection open but reads nothing),
    or ``limit`` seconds after it began (``overdue``).

    The relay calls ``sending_started()`` / ``sent(event_ended)`` around each chunk (a clock read
    each); a single timer re-arms itself instead of being rescheduled per chunk. Time spent blocked
    sending does not count as the instance's silence.
    """

    __slots__ = (
        "_end",
        "_handle",
        "_idle",
        "_loop",
        "_task",
        "expired",
        "idle",
        "last",
        "limit",
        "overdue",
        "send_started",
        "stall",
        "stalled",
    )

    def __init__(self, idle: float, stall: float | None = None, limit: float | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        assert task is not None, "IdleGuard must be created inside a task"
        self._task = task
        self.idle, self.stall, self.limit = idle, stall, limit  # as given (``_idle`` ends at ``finishing``)
        self._idle = idle
        self.expired = False
        self.stalled = False
        self.overdue = False
        self.send_started: float | None = None  # set while blocked writing to the client
        self.last = self._loop.time()  # when the last event ended (or the stream began)
        self._end = self.last + limit if limit is not None else math.inf
        self._handle: asyncio.TimerHandle | None = self._loop.call_at(self._next(self.last), self._check)

    def _next(self, now: float) -> float:
        started = self.send_started
        if started is not None:  # blocked on the client: only the stall limit applies
            at = started + self.stall if self.stall is not None else now + self._idle
            return min(at, self._end)
        deadline = min(self.last + self._idle, self._end)
        if self.stall is not None:  # a send may block before the next check
            deadline = min(deadline, now + self.stall)
        return deadline

    def sending_started(self) -> None:
        self.send_started = self._loop.time()

    def sent(self, event_ended: bool = True) -> None:
        now = self._loop.time()
        started, self.send_started = self.send_started, None
        if event_ended:
            self.last = now
        elif started is not None:
            self.last += now - started  # blocked on the client: not the instance's silence

    def finishing(self) -> None:
        """The stream's events are all relayed: only a client that stops reading ends it now."""
        self._idle = self._end = math.inf
        if self._handle is None and self.stall is not None:  # a guard that fired is armed again
            self._handle = self._loop.call_at(self._next(self._loop.time()), self._check)

    def _check(self) -> None:
        now = self._loop.time()
        if now >= self._end:
            self._handle = None
            self.overdue = True
            self._task.cancel()
            return
        started = self.send_started
        if started is not None and self.stall is not None and now - started >= self.stall:
            self._handle = None
            self.stalled = True
            self._task.cancel()
            return
        if started is None and now >= self.last + self._idle:
            self._handle = None
            self.expired = True
            self._task.cancel()
            return
        self._handle = self._loop.call_at(max(self._next(now), now + 1e-3), self._check)

    def close(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
