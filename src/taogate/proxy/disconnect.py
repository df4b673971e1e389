"""Watching for a client that leaves while its request is served: the serving task is cancelled,
which releases the lease and closes the upstream connection (vLLM then aborts the request).

A request is watched only once it has lasted ``after`` seconds (up to twice that): most requests a
gateway sees at high rates finish sooner. One timer serves every request in flight, ticking every
``after`` seconds while any is watched: a timer armed and cancelled per request cost more than the
rest of the watch (benchmarks/README.md). A client that left earlier is seen then, since the
listener's cycle (``taogate.cycle.Cycle.receive``) answers ``http.disconnect`` at once for a
connection already gone: an abort at most ``2 * after`` late, on requests that cost the instance
little so far.
"""

from __future__ import annotations

import asyncio
from typing import Any, Protocol

from starlette.types import Receive

__all__ = ["DisconnectWatch", "DisconnectWatcher"]


class Watched(Protocol):
    """What the watch asks of the request it watches."""

    @property
    def finished(self) -> bool:
        """The last body message is being sent: a disconnect now is not a hang-up."""

    @property
    def reading(self) -> bool:
        """``receive()`` still belongs to the request's streamed body."""


class DisconnectWatcher:
    """The watches of one pipeline and their shared timer. ``watch()`` arms one for the current
    task; its ``stop()`` when serving ends, whichever way, forgets it."""

    __slots__ = ("_after", "_armed", "_pending", "_ticks")

    def __init__(self, after: float) -> None:
        self._after = after
        #: Watches not listening yet, with the number of ticks before they came: one lasted at least
        #: ``after`` at the second tick after it came, and at most ``2 * after``.
        self._pending: dict[DisconnectWatch, int] = {}
        self._ticks = 0
        self._armed = False  # the timer is set: it runs until no watch is pending

    def watch(self, watched: Watched, receive: Receive) -> DisconnectWatch:
        task = asyncio.current_task()
        assert task is not None
        watch = DisconnectWatch(self, task, watched, receive)
        self._pending[watch] = self._ticks
        if not self._armed:
            self._armed = True
            task.get_loop().call_later(self._after, self._tick)
        return watch

    def forget(self, watch: DisconnectWatch) -> None:
        self._pending.pop(watch, None)

    def _tick(self) -> None:
        self._ticks = ticks = self._ticks + 1
        # receive() is a streamed body's until its end: such a request waits a tick more.
        due = [w for w, came in self._pending.items() if came <= ticks - 2 and not w.watched.reading]
        for watch in due:
            del self._pending[watch]
            watch.listen()
        self._armed = bool(self._pending)
        if self._armed:
            asyncio.get_running_loop().call_later(self._after, self._tick)

    @property
    def pending(self) -> int:
        """Requests watched and not listened to yet (none once all have ended)."""
        return len(self._pending)


class DisconnectWatch:
    """One request's watch: ``left()`` after a cancellation says whether it was this watch's, for a
    client that went away."""

    __slots__ = ("_gone", "_listener", "_receive", "_task", "_watcher", "watched")

    def __init__(
        self, watcher: DisconnectWatcher, task: asyncio.Task[Any], watched: Watched, receive: Receive
    ) -> None:
        self._watcher = watcher
        self._task = task
        self.watched = watched
        self._receive = receive
        self._gone = False
        self._listener: asyncio.Future[Any] | None = None

    def listen(self) -> None:
        """Wait for the client's next message: after the body, only ``http.disconnect`` comes."""
        self._listener = asyncio.ensure_future(self._receive())
        self._listener.add_done_callback(self._on_message)

    def _on_message(self, fut: asyncio.Future[Any]) -> None:
        # The cycle answers receive() with http.disconnect once the response is complete, too; and
        # a listener that ended as stop() came is no longer this watch's.
        if fut is not self._listener or self.watched.finished:
            return
        if fut.cancelled() or fut.exception() is not None:
            return
        self._gone = True
        self._task.cancel()

    def left(self) -> bool:
        """After a CancelledError: the client left, and nothing else cancelled the task."""
        return self._gone and self._task.uncancel() == 0

    def stop(self) -> None:
        """No more watching; drops the listener (and with it every reference back)."""
        self._watcher.forget(self)
        listener, self._listener = self._listener, None
        if listener is not None:
            listener.cancel()
