"""The lease that holds one instance slot for one attempt.

A ``Lease`` is taken when a request is sent to an instance and holds its slot (in-flight count,
outstanding prefill tokens) until the response body has been fully relayed, the client has gone
away, or an error has ended the attempt. ``release()`` is idempotent, so every exit path may call
it and the counts still return to exactly zero. Until its first token, a lease also sits in its
instance's ``pending`` (dispatch order), the evidence ``dispatch.pending.speed_bound`` reads: a
request that has waited longer than its work should take says the instance is slower than learned.
"""

from __future__ import annotations

from collections.abc import Callable

from taogate.dispatch.cache_model import Ticket
from taogate.fleet.instance import Instance

__all__ = ["Lease"]


class Lease:
    """Holds one instance slot for one attempt; counts return exactly once, whatever the exit path.

    ``tokens`` is the prefill work booked for this request (its estimated prompt); ``ahead_tokens``
    the work booked ahead of it at dispatch; ``sent_at`` the dispatcher's clock then; ``stream`` and
    ``max_tokens`` say how its first token will be seen (see ``Instance.waiting``). ``work`` is the
    prefill expected there (the prompt less its expected cache hit), ``ticket`` what the instance's
    cache model recorded for it (taken out again at release).
    """

    __slots__ = (
        "_first",
        "_on_release",
        "_released",
        "ahead_tokens",
        "cached",
        "instance",
        "max_tokens",
        "receipt",
        "sent_at",
        "stream",
        "ticket",
        "tokens",
        "trial",
        "work",
    )

    def __init__(
        self,
        instance: Instance,
        tokens: int,
        on_release: Callable[[Lease], None],
        *,
        trial: bool = False,
        sent_at: float = 0.0,
        stream: bool = True,
        max_tokens: int | None = None,
        work: int | None = None,
        ticket: Ticket | None = None,
    ) -> None:
        self.instance = instance
        self.tokens = tokens
        self.work = tokens if work is None else work
        self.ticket = ticket
        self.cached: int | None = None  # prompt tokens the engine served from its cache (its usage)
        self.receipt: str | None = None  # why it was sent here (``dispatch.receipt``), when asked
        self.trial = trial  # this attempt is the breaker's half-open trial
        self.sent_at = sent_at
        self.stream = stream
        self.max_tokens = max_tokens
        self._on_release = on_release
        self._first = False
        self._released = False
        self.ahead_tokens = instance.book(self, tokens, self.work)  # our prefill queued ahead of it

    @property
    def released(self) -> bool:
        return self._released

    def first_token(self) -> None:
        """The prefill is done: its tokens no longer count as queued prefill work."""
        if self._first or self._released:
            return
        self._first = True
        self.instance.prefilled(self, self.tokens, self.work)
        ticket = self.ticket
        if ticket is not None and ticket.key is not None:  # its prefix computed: later ones may hit it
            self.instance.cache.computed(ticket)

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        inst = self.instance
        inst.unbook(self, self.tokens, self.work, self._first)
        if self.trial:
            inst.breaker.release_trial()
        self._on_release(self)
