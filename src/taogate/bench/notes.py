"""What the in-process gateways of ``bench``, ``diagnose`` and ``demo`` log: held, then said once.

Each row of a comparison and each run of the bisection has a gateway of its own, and each would log
the same thing as it comes (a scrape of /metrics slower than its interval on a busy machine, one
card flagged slow by every gateway at a different ratio), before the tables and the verdict that
carry the figure. The lines are held while the runs go, then printed after them, one per kind (the
log call's message template) with the number of repeats.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

from rich.console import Console

__all__ = ["HeldLogs", "held_logs"]

HEADING = "the in-process gateways warned (one line per kind)"


class HeldLogs(logging.Handler):
    """Records at WARNING and above, grouped by their message template, first seen first."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.kinds: dict[str, list[logging.LogRecord]] = {}

    def emit(self, record: logging.LogRecord) -> None:
        self.kinds.setdefault(str(record.msg), []).append(record)

    def lines(self) -> list[str]:
        """One line per kind: the first message, and how many more like it there were."""
        out = []
        for records in self.kinds.values():
            more = len(records) - 1
            out.append(records[0].getMessage() + (f" ({more} more like it)" if more else ""))
        return out

    def flush_to(self, console: Console, heading: str = HEADING) -> None:
        """Print what was held since the last flush, then forget it."""
        lines = self.lines()
        self.kinds.clear()
        if lines:
            console.print(f"{heading}:", markup=False, highlight=False)
            for line in lines:
                console.print(f"  - {line}", markup=False, highlight=False)


@contextlib.contextmanager
def held_logs(name: str = "taogate") -> Iterator[HeldLogs]:
    """Hold the ``name`` logger's records (and its children's) instead of printing them."""
    logger = logging.getLogger(name)
    handler = HeldLogs()
    propagate = logger.propagate
    logger.addHandler(handler)
    logger.propagate = False
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.propagate = propagate
