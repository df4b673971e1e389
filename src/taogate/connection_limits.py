"""What one server's client connections may cost, and what they share to keep to it.

``ListenerLimits`` bounds a request's head (URL, fields, bytes, time) and the number of open
connections. A head past a bound is refused with a ``Reject`` (its status and error code), in the
error shape of the API its path belongs to. The connections of one server share a
``ConnectionCensus``: which are idle (oldest first) and which are lingering after a refusal, so
that a newcomer past the cap can take the place of one of them, and the warnings, logged at most
every few seconds per kind.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from taogate.errors import ErrorShape, openai_everywhere

__all__ = ["ConnectionCensus", "ListenerLimits", "Reject", "field_refused", "too_large"]

log = logging.getLogger("taogate.listener")

#: Seconds between two warnings of one kind (the count in between is reported).
_WARN_EVERY_S = 10.0


@dataclass(frozen=True, slots=True)
class ListenerLimits:
    max_header_bytes: int = 64 * 1024
    max_headers: int = 100
    max_url_bytes: int = 8 * 1024
    header_timeout: float = 10.0
    max_connections: int = 4096
    write_stall: float | None = None  # seconds a write may wait for a client that reads nothing
    errors_at: Callable[[str], ErrorShape] = openai_everywhere  # a refusal's shape, by its path


class Reject(Exception):
    """Raised in a parser callback: the request is answered ``status`` and the connection closed."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message


def field_refused(limits: ListenerLimits, fields: int) -> Reject:
    """Why one more field is refused: too many of them, else a head too large."""
    if fields >= limits.max_headers:
        return Reject(431, "too_many_headers", f"More than {limits.max_headers} request header fields.")
    return too_large(limits)


def too_large(limits: ListenerLimits) -> Reject:
    return Reject(431, "header_too_large", f"The request head exceeds {limits.max_header_bytes} bytes.")


class Connection(Protocol):
    """What the census asks of a connection: its transport, to close it."""

    @property
    def transport(self) -> asyncio.Transport: ...


@dataclass(slots=True)
class ConnectionCensus:
    """State shared by one server's connections."""

    limits: ListenerLimits
    idle: dict[Connection, None] = field(default_factory=dict)  # oldest first
    lingering: dict[Connection, None] = field(default_factory=dict)
    _warned: dict[str, tuple[float, int]] = field(default_factory=dict)

    def warn(self, kind: str, message: str) -> None:
        """A warning per kind at most every few seconds, with how many were not logged."""
        now = time.monotonic()
        last, skipped = self._warned.get(kind, (0.0, 0))
        if now - last < _WARN_EVERY_S:
            self._warned[kind] = (last, skipped + 1)
            return
        self._warned[kind] = (now, 0)
        more = f" ({skipped} more since the last such warning)" if skipped else ""
        log.warning("%s%s", message, more)

    def shed(self, newcomer: Connection) -> bool:
        """Close a lingering connection, else the longest-idle one, to make room; False when none
        is either."""
        for pool in (self.lingering, self.idle):
            for victim in pool:
                if victim is not newcomer:
                    del pool[victim]
                    victim.transport.abort()  # close() would wait for a client that does not read
                    return True
        return False
