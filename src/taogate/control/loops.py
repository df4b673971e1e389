"""Background tasks owned by the gateway's lifespan: periodic rounds and one-shot jobs.

Each round runs on its own schedule and never blocks requests; a failing round is logged and the
loop goes on. Intervals are read at every tick, so a config reload takes effect without a restart.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Collection, Coroutine
from typing import Any

__all__ = ["Background", "cancel_all"]

log = logging.getLogger("taogate.health")

Round = Callable[[], Awaitable[None]]


class Background:
    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[None]] = set()

    def every(self, interval: Callable[[], float], tick: Round) -> None:
        """Run ``tick`` after each ``interval()`` seconds of sleep (0 or less: paused, looked at again
        each second); a reloaded interval counts from the next sleep."""
        self._spawn(self._loop(tick, interval))

    def once(self, job: Coroutine[Any, Any, None]) -> None:
        self._spawn(job)

    def _spawn(self, job: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(job)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    @staticmethod
    async def _loop(tick: Round, interval: Callable[[], float]) -> None:
        while True:
            period = interval()
            if period <= 0:
                await asyncio.sleep(1.0)
                continue
            await asyncio.sleep(period)
            try:
                await tick()
            except Exception:  # a probe bug must not end probing
                log.exception("background probe round failed")
            task = asyncio.current_task()
            if task is not None and task.cancelling():  # a cancel swallowed inside the round
                raise asyncio.CancelledError

    async def stop(self) -> None:
        """Cancel every task and wait for it (``cancel_all``)."""
        await cancel_all(self._tasks, "probe")
        self._tasks.clear()


async def cancel_all(tasks: Collection[asyncio.Task[Any]], what: str) -> None:
    """Cancel ``tasks`` and wait for them, cancelling again while one still runs, for 10 s at most:
    on Python 3.11 a cancellation that lands as an ``asyncio.timeout`` inside the task expires can
    be taken for that timeout and swallowed (seen: a loop that went on probing, and a shutdown that
    waited for it for ever). ``what`` names the tasks in the log."""
    pending = set(tasks)
    for _ in range(100):
        if not pending:
            break
        for task in pending:
            task.cancel()
        done, pending = await asyncio.wait(pending, timeout=0.1)
        for task in done:  # retrieved, so none is reported as "never retrieved"
            if not task.cancelled() and task.exception() is not None:
                log.error("%s task ended with %r", what, task.exception())
    if pending:
        log.error("%d %s tasks ignored cancellation; leaving them behind", len(pending), what)
