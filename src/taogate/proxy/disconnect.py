"""Watching for a client that leaves while its request is served: the serving task is cancelled,
which releases the lease and closes the upstream connection (vLLM then aborts the request).

The watch starts only once the request has lasted ``after`` seconds: most requests a gateway sees at
high rates finish sooner, and a timer is cheaper than a task. A client that left earlier is seen
then, since uvicorn answers ``receive()`` with ``http.disconnect`` at once for a connection already
gone: an abort at most ``after`` late, on requests that cost the instance little so far.
"""

from __future__ import annotations

import asyncio
from typing import Any, Protocol

from starlette.types import Receive

__all__ = ["DisconnectWatch"]


class Watched(Protocol):
    """What the watch asks of the request it watches."""

    @property
    def finished(self) -> bool:
        """The last body message is being sent: a disconnect now is not a hang-up."""

    @property
    def reading(self) -> bool:
        """``receive()`` still belongs to the request's streamed body."""


class DisconnectWatch:
    """Armed on creation for the current task; ``stop()`` when serving ends, whichever way.
    ``left()`` after a cancellation: whether it was this watch's, for a client that went away."""

    __slots__ = ("_after", "_gone", "_listener", "_loop", "_receive", "_task", "_timer", "_watched")

    def __init__(self, watched: Watched, receive: Receive, after: float) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._task = task
        self._loop = task.get_loop()
        self._watched = watched
        self._receive = receive
        self._after = after
        self._gone = False
        self._listener: asyncio.Future[Any] | None = None
        self._timer: asyncio.TimerHandle | None = self._loop.call_later(after, self._watch)

    def _watch(self) -> None:
        if self._timer is None:
            return  # stopped
        if self._watched.reading:  # receive() is the streamed body's until its end
            self._timer = self._loop.call_later(self._after, self._watch)
            return
        self._listener = asyncio.ensure_future(self._receive())
        self._listener.add_done_callback(self._on_message)

    def _on_message(self, fut: asyncio.Future[Any]) -> None:
        # uvicorn answers receive() with http.disconnect once the response is complete, too.
        if self._timer is None or self._watched.finished or fut.cancelled() or fut.exception() is not None:
            return
        self._gone = True
        self._task.cancel()

    def left(self) -> bool:
        """After a CancelledError: the client left, and nothing else cancelled the task."""
        return self._gone and self._task.uncancel() == 0

    def stop(self) -> None:
        """No more watching; drops the timer and the listener (and with them every reference back)."""
        timer, self._timer = self._timer, None
        if timer is not None:
            timer.cancel()
        listener, self._listener = self._listener, None
        if listener is not None:
            listener.cancel()
