"""Logging for ``taogate serve``: one format for every line, and a cheap path for the access lines.

The access log writes one line per request, so its cost is a gateway's per-request cost: its lines
go into a buffer of their own, flushed by the server every ``ACCESS_FLUSH_S`` (and at exit), with
the time stamp formatted once per second. Whole lines only reach the fd, so they never interleave
with the other log lines on stderr.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import time
from typing import Any

from mypy_extensions import mypyc_attr

__all__ = [
    "ACCESS_FLUSH_S",
    "ACCESS_LOGGER",
    "LOG_FORMAT",
    "BatchedStreamHandler",
    "flush_every",
    "setup_logging",
]

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
ACCESS_FLUSH_S = 0.5
ACCESS_LOGGER = "taogate.access"
#: ``,000`` to ``,999``: a time stamp's milliseconds, looked up instead of formatted per line.
_MILLIS = tuple(f",{ms:03d}" for ms in range(1000))


@mypyc_attr(native_class=False)
class SecondCachedFormatter(logging.Formatter):
    """``logging.Formatter`` with the default time format, formatting each second's date and time
    once instead of once per line (``time.localtime`` and ``strftime`` were a good part of an access
    line's cost; measured: benchmarks/overhead.py). The output is the standard one:
    ``2026-11-30 21:55:49,123``."""

    def __init__(self, fmt: str) -> None:
        super().__init__(fmt)
        self._second = -1
        self._stamp = ""

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        if datefmt is not None:
            return super().formatTime(record, datefmt)
        return self.stamp(record.created)

    def stamp(self, created: float) -> str:
        """``%(asctime)s`` for a record created at ``created`` (as ``time.time()``)."""
        second = int(created)
        if second != self._second:
            self._stamp = time.strftime(self.default_time_format, self.converter(created))
            self._second = second
        # as logging.Formatter.default_msec_format, with LogRecord's msecs
        return self._stamp + _MILLIS[int((created - second) * 1000)]


@mypyc_attr(native_class=False)
class BatchedStreamHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """The per-request access lines, written into a 64 KiB buffer of their own and flushed every
    ``ACCESS_FLUSH_S`` by the server (and at exit), not one write(2) per line: sys.stderr is
    line-buffered, and a syscall per request was a large part of the access log's cost (measured:
    benchmarks/overhead.py). Whole lines only reach the fd, so they never interleave with the other
    log lines on stderr."""

    def __init__(self) -> None:
        try:
            stream: Any = open(sys.stderr.fileno(), "w", buffering=65536, closefd=False)  # noqa: SIM115
        except (AttributeError, OSError, ValueError):  # no real fd (captured): plain stderr
            stream = sys.stderr
        super().__init__(stream)

    def flush(self) -> None:
        """Called by ``emit`` after every line: a no-op; ``flush_now`` does the work."""

    def write_info(self, name: str, message: str) -> None:
        """One INFO line of logger ``name``, the text ``LOG_FORMAT`` gives, without a LogRecord.

        The gateway's access log writes through this when ``taogate serve`` runs it: building and
        handling a record was most of an access line's cost (measured: benchmarks/overhead.py).
        Only the access logger writes to this handler's stream, from the event loop."""
        formatter = self.formatter
        assert isinstance(formatter, SecondCachedFormatter), "setup_logging sets the formatter"
        try:  # noqa: SIM105 (contextlib.suppress: an instance and two calls more per request)
            self.stream.write(f"{formatter.stamp(time.time())} INFO {name}: {message}\n")
        except (OSError, ValueError):
            pass

    def flush_now(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            self.stream.flush()

    def close(self) -> None:
        self.flush_now()
        super().close()


def setup_logging(level: str) -> BatchedStreamHandler:
    # Records need no thread or process fields (the format shows neither): skip looking them up.
    logging.logThreads = logging.logProcesses = logging.logMultiprocessing = False
    logging.basicConfig(level=level.upper(), format=LOG_FORMAT, stream=sys.stderr)
    # Health probes and scrapes would log a line each; state changes are logged by taogate itself.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    access = logging.getLogger(ACCESS_LOGGER)
    for old in [h for h in access.handlers if isinstance(h, BatchedStreamHandler)]:
        access.removeHandler(old)
        old.close()
    handler = BatchedStreamHandler()
    handler.setFormatter(SecondCachedFormatter(LOG_FORMAT))
    access.addHandler(handler)
    access.propagate = False
    return handler


async def flush_every(handler: BatchedStreamHandler, seconds: float) -> None:
    try:
        while True:
            await asyncio.sleep(seconds)
            handler.flush_now()
    finally:
        handler.flush_now()
