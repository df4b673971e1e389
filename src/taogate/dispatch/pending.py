"""Evidence from requests still waiting for their first token: a bound on an instance's speed now.

``SpeedEstimator`` learns from completed requests; this reads the ones that have not answered yet,
which is all there is at a cold start or when a card degrades mid-run (see ``speed_bound``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import NamedTuple

__all__ = ["Pending", "speed_bound"]


class Pending(NamedTuple):
    """One of our requests on an instance that has no first token yet."""

    work: float  # prefill tokens that must be done before its first token: booked ahead + its own
    elapsed: float  # seconds since it was dispatched
    allowance: float = 0.0  # seconds of ``elapsed`` not spent on prefill (a non-stream's decode)


def speed_bound(pending: Iterable[Pending], base: float = 0.0) -> float:
    """An upper bound on an instance's speed *now*, from requests still waiting for their first token.

    A request dispatched ``elapsed`` seconds ago behind ``work`` tokens (the work booked ahead of it
    plus its own) and still without a first token shows that the instance has done less than ``work``
    in ``elapsed - base - allowance`` seconds: its speed is at most ``work / that``. This is evidence
    before any sample completes, which matters at a cold start (a slow card looks like the others
    until its first TTFT arrives, seconds later for long prompts) and when a card degrades mid-run
    (thermal throttling, a noisy neighbour, another gateway's burst on vLLM). While requests are on
    time the bound stays above the learned speed and changes nothing. For a non-stream request the
    "first token" is only seen with the whole response, so its decode (``max_tokens`` × the learned
    seconds per output token) is the ``allowance``. ``inf`` when no request says anything.
    """
    bound = math.inf
    for p in pending:
        seconds = p.elapsed - base - p.allowance
        if seconds > 0 and p.work > 0:
            bound = min(bound, p.work / seconds)
    return bound
