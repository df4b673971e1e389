"""What a pool is told, as one value: its timeouts and the bounds on a reply's head. A new one is
swapped in whole (a config reload); requests read it as they go."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Limits"]


@dataclass(frozen=True, slots=True)
class Limits:
    connect_timeout: float
    read_timeout: float | None  # silence, or a head in all; None: none
    pool_timeout: float  # waiting for a free connection slot
    max_header_bytes: int = 64 * 1024  # a reply's head; over it: MalformedResponse
    max_headers: int = 100
