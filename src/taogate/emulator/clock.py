"""Clocks for the emulator: the real one and a virtual one for tests.

Why a seam here: the engine model is pure (it only returns step durations), but the async driver has to
wait those durations out. Injecting the clock lets tests run the whole driver in virtual time, where a
``sleep`` advances the clock instantly instead of blocking the event loop.
"""

from __future__ import annotations

import asyncio
import time
from typing import Protocol

__all__ = ["Clock", "SystemClock", "VirtualClock"]


class Clock(Protocol):
    """What the emulator needs from time: a reading in seconds and a way to wait."""

    def now(self) -> float:
        """Seconds on this clock's scale (only differences matter, except in request records)."""
        ...

    async def sleep(self, seconds: float) -> None:
        """Wait ``seconds`` on this clock."""
        ...


class SystemClock:
    """Wall-clock time, so request records of separate emulator processes can be compared."""

    def now(self) -> float:
        return time.time()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(max(0.0, seconds))


class VirtualClock:
    """A clock that only moves when someone sleeps on it; sleeping never blocks for real.

    Each ``sleep`` advances the reading by the requested amount, then yields once to the event loop so
    other tasks observe the new time. Good enough for a single sleeper (the engine driver); concurrent
    sleepers simply add up, which tests that need exact timing avoid.
    """

    def __init__(self, start: float = 0.0) -> None:
        self._now = start

    def now(self) -> float:
        return self._now

    def advance(self, seconds: float) -> None:
        """Move time forward without yielding."""
        self._now += max(0.0, seconds)

    async def sleep(self, seconds: float) -> None:
        self.advance(seconds)
        await asyncio.sleep(0)
