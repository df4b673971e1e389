"""The /metrics page, with its renders bounded whatever the scrape rate.

/metrics answers without a key (Prometheus scrapes it so), and one render walks every metric family
(milliseconds of CPU for a fleet's worth of series); rendered per scrape, a client polling it in a
loop would take the event loop from the traffic. Renders are paid from a bucket of ``burst`` that
refills one per ``every`` seconds: a scrape with a render in the bucket gets a fresh page; one
without gets the last page, which is then less than ``every`` seconds old. So a few scrapes in a
row (a person, a test) see fresh pages, and a flood costs at most one render per ``every`` seconds;
a scrape in between costs what any small answer costs.
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["RENDER_BURST", "RENDER_EVERY", "Exposition"]

#: Seconds per render once the burst is spent, and the burst.
RENDER_EVERY = 1.0
RENDER_BURST = 8


class Exposition:
    """``page()``: a fresh render of ``render()`` while the bucket allows, else the last one."""

    __slots__ = ("_at", "_burst", "_clock", "_every", "_page", "_render", "_tokens", "renders")

    def __init__(
        self,
        render: Callable[[], bytes],
        clock: Callable[[], float],
        every: float = RENDER_EVERY,
        burst: int = RENDER_BURST,
    ) -> None:
        self._render = render
        self._clock = clock
        self._every = every
        self._burst = burst
        self._tokens = float(burst)
        self._page: bytes | None = None
        self._at = clock()  # when the bucket was last filled
        self.renders = 0

    def page(self) -> bytes:
        now = self._clock()
        self._tokens = min(self._burst, self._tokens + (now - self._at) / self._every)
        self._at = now
        if self._page is None or self._tokens >= 1:
            self._page = self._render()  # synchronous, on the loop: never two at once
            self._tokens -= 1
            self.renders += 1
        return self._page
