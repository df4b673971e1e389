"""Deadlines for many short waits at once, kept by one timer that runs only while some are pending.

A timer per request (``asyncio.timeout``) costs more than the rest of reading a small body, and
almost every body is in before anything could expire; here a request pays two dict operations,
and an expired one is cancelled within ``every`` seconds of its deadline.
"""

from __future__ import annotations

import asyncio

__all__ = ["Deadlines"]


class Deadlines:
    """``start(within)`` in a task, ``done(task)`` at the end of its wait (whatever the outcome); a
    task still waiting past its deadline is cancelled, and ``expired(task)`` then says it was this."""

    __slots__ = ("_due", "_every", "_expired", "_timer")

    def __init__(self, every: float = 0.25) -> None:
        self._every = every
        self._due: dict[asyncio.Task[object], float] = {}
        self._expired: set[asyncio.Task[object]] = set()
        self._timer: asyncio.TimerHandle | None = None

    def start(self, within: float) -> asyncio.Task[object]:
        """The current task's wait begins; returns the task, for ``done`` and ``expired``."""
        task = asyncio.current_task()
        assert task is not None, "a deadline belongs to a task"
        loop = task.get_loop()
        self._due[task] = loop.time() + within
        if self._timer is None:
            self._timer = loop.call_later(min(self._every, within), self._sweep)
        return task

    def done(self, task: asyncio.Task[object]) -> None:
        self._due.pop(task, None)

    def expired(self, task: asyncio.Task[object]) -> bool:
        """Whether ``task`` was cancelled for its deadline (asked once, after the cancel)."""
        if task not in self._expired:
            return False
        self._expired.discard(task)
        return True

    def _sweep(self) -> None:
        loop = asyncio.get_running_loop()
        now = loop.time()
        for task, due in list(self._due.items()):
            if now >= due:
                del self._due[task]
                self._expired.add(task)
                task.cancel()
        self._timer = loop.call_later(self._every, self._sweep) if self._due else None
