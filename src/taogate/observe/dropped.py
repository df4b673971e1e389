"""Responses the gateway leaves unfinished on purpose, and the server's complaint about them.

A client that keeps its connection open but stops reading is dropped after ``client_stall_timeout``:
its response cannot be finished, so the ASGI call returns with it incomplete and uvicorn closes the
connection, logging "ASGI callable returned without completing response." at ERROR. For a drop the
gateway chose, and logged itself as a warning, that line is noise on an operator's error dashboard;
for anything else it would be a bug worth seeing. ``DroppedResponses`` is told of each deliberate
drop and filters out one such line per drop, if it comes within a few seconds.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable

from mypy_extensions import mypyc_attr

__all__ = ["INCOMPLETE_RESPONSE", "SERVER_LOGGER", "DroppedResponses"]

#: What uvicorn logs when an ASGI call returns before its response is complete, and where.
INCOMPLETE_RESPONSE = "ASGI callable returned without completing response."
SERVER_LOGGER = "uvicorn.error"


@mypyc_attr(native_class=False)
class DroppedResponses(logging.Filter):
    """A logging filter for ``SERVER_LOGGER``: one incomplete-response line hidden per ``expect()``."""

    def __init__(self, window: float = 5.0, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self._window = window
        self._clock = clock
        self._expected: deque[float] = deque()  # deadlines, oldest first

    def expect(self) -> None:
        """The gateway is about to return without completing a response, on purpose (whose line
        the server may not log: the client gone too, or no server's response at all)."""
        now = self._clock()
        self._expire(now)
        self._expected.append(now + self._window)

    def __len__(self) -> int:
        """Drops still expected (one past its window goes at the next ``expect`` or line)."""
        return len(self._expected)

    def _expire(self, now: float) -> None:
        while self._expected and self._expected[0] < now:
            self._expected.popleft()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg != INCOMPLETE_RESPONSE or not self._expected:
            return True
        self._expire(self._clock())
        if not self._expected:
            return True
        self._expected.popleft()
        return False
