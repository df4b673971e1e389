"""An instance's batch slots: how many requests its engine runs at once, and how long one lasts.

vLLM runs at most ``max_num_seqs`` sequences at a time (fewer when its KV cache is full); the rest
wait in its queue until a running one ends. A request sent to a full instance waits for that, not
for prefill work, so dispatch must cost it apart: on a fleet of equal cards a third request on a
two-slot card waits a whole answer while the other card has a slot free.

Nothing in vLLM's /metrics says the limit, but each scrape says ``running`` and ``waiting``: the most
requests seen running is a lower bound on the slots, and requests waiting while that many run show
it is the limit, unless what holds them back is the step's token budget (``max_num_batched_tokens``:
a long prompt's chunks fill it and the next prompt waits a step, which the prefill queued ahead
already costs). So the engine counts as full only when no more of the gateway's requests there lack
a first token than are waiting: all of its running ones are decoding, and still the rest wait. A
non-streamed request shows its first token only with its end, so traffic that is all non-streamed
never shows the engine full: its slots stay unknown, as before.
Until the engine has been seen full, the slots are unknown and cost nothing (a fleet that never
fills them is dispatched as before). A limit seen once stays until more run (the KV cache may admit
more for shorter prompts): then it is unknown again until the engine fills again.

The wait is costed at the mean answer time there over the slots (one of them frees that often).
"""

from __future__ import annotations

__all__ = ["BatchSlots"]

#: How fast the mean answer time follows new answers (an EWMA step).
_STEP = 0.2


class BatchSlots:
    """Learned from scrapes (``observe``) and finished answers (``served``); read by fleet views."""

    __slots__ = ("_full", "_most", "served_seconds")

    def __init__(self) -> None:
        self._most = 0  # the most requests seen running at once
        self._full = False  # requests waited while that many ran: it is the limit
        self.served_seconds = 0.0  # mean seconds from sending a request here to its answer's end

    def observe(self, running: float | None, waiting: float | None, prefilling: int = 0) -> None:
        """One scrape's ``vllm:num_requests_running`` and ``vllm:num_requests_waiting``, with the
        gateway's requests there that have no first token yet (``prefilling``)."""
        if running is None:
            return
        run = int(running)
        if run > self._most:
            self._most, self._full = run, False
        if waiting and waiting > 0 and run >= self._most > 0 and prefilling <= waiting:
            self._full = True

    def served(self, seconds: float) -> None:
        """A request here ended after ``seconds`` (sent to done)."""
        if seconds > 0.0:
            if self.served_seconds <= 0.0:
                self.served_seconds = seconds
            else:
                self.served_seconds += _STEP * (seconds - self.served_seconds)

    @property
    def limit(self) -> int:
        """The slots, once the engine has been seen full with them (0: unknown, no limit costed)."""
        return self._most if self._full else 0

    @property
    def wait(self) -> float:
        """Seconds a request beyond the slots waits per request ahead of it for one to free."""
        limit = self.limit
        return self.served_seconds / limit if limit else 0.0
