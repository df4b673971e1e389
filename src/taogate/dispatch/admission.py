"""Admission: send a request now (and where), make it wait for a slot, or refuse it.

``decide`` is a pure function of the request's facts and a snapshot of the fleet:

1. **Model.** If some instance has told us its models and none serves the request's model, the model
   does not exist here: ``Refuse("model_not_found")`` (404). Instances that have not listed their
   models yet are assumed to serve anything.
2. **Eligible** instances: available (healthy, breaker allows), serving the model, not excluded (a
   retry never goes back to the instance that just failed it), and in the request's channel: a long
   request (``req.long``) goes to role ``long`` or ``any``, a short one to ``short`` or ``any``.
3. **Channel fallback.** When the request's own channel has *no* eligible instance at all (all down,
   excluded or not serving the model; merely busy does not count), the other channel's instances are
   used and the ``Send`` says ``channel_fallback=True``. Availability beats isolation: a long prompt
   that waits behind short ones is better than a 503 while instances are up, and the flag lets logs
   and metrics show that the isolation was given up.
4. Eligible instances **with room** (in-flight under the cap) go to ``policy.choose``.
5. None with room: the **overflow** instance, when it has room (``reason="overflow"``); it is used only
   when every eligible primary is at its cap, including when none is eligible at all.
6. Otherwise ``Wait`` if anything eligible exists (a slot will free: the gateway queue re-decides the
   moment one does), or ``Refuse("no_instance")`` (503) when nothing could ever take the request.

Work-conserving: it never answers ``Wait`` while an eligible instance has room.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import replace

from .policy import Policy
from .types import Decision, InstanceView, Refuse, RequestFacts, Send, Wait

__all__ = ["candidates", "decide", "retry_after_seconds"]


def decide(
    req: RequestFacts,
    views: Sequence[InstanceView],
    policy: Policy,
    exclude: Collection[str] = frozenset(),
) -> Decision:
    """Send, Wait or Refuse for ``req`` over the fleet snapshot ``views`` (see the module docstring)."""
    model = req.model
    if model is not None and any(v.models for v in views) and not any(v.serves(model) for v in views):
        return Refuse("model_not_found")

    usable = [v for v in views if v.available and v.serves(model) and v.name not in exclude]
    eligible, fallback = _channel(req, usable)
    room = [v for v in eligible if v.has_room]
    if room:
        send = policy.choose(req, room, [v.name for v in eligible])
        if send is not None:
            return replace(send, channel_fallback=True) if fallback else send

    overflow = [v for v in usable if v.overflow]
    spare = [v for v in overflow if v.has_room]
    if spare:
        target = max(spare, key=lambda v: (v.cap - v.inflight, v.name))
        return Send(target.name, "overflow", channel_fallback=fallback)
    if eligible or overflow:
        return Wait()
    return Refuse("no_instance")


def _channel(req: RequestFacts, usable: Sequence[InstanceView]) -> tuple[list[InstanceView], bool]:
    """The primaries in the request's channel, or all primaries (``True``) when it has none."""
    own = ("long", "any") if req.long else ("short", "any")
    primaries = [v for v in usable if not v.overflow]
    eligible = [v for v in primaries if v.role in own]
    if not eligible and primaries:
        return primaries, True
    return eligible, False


def candidates(
    req: RequestFacts, views: Sequence[InstanceView], exclude: Collection[str] = frozenset()
) -> list[InstanceView]:
    """The instances ``decide`` hands to the policy for ``req``: eligible, in its channel, with room."""
    usable = [v for v in views if v.available and v.serves(req.model) and v.name not in exclude]
    return [v for v in _channel(req, usable)[0] if v.has_room]


def retry_after_seconds(
    queue_len: int,
    drain_rate_per_s: float,
    *,
    unknown: float = 10.0,
    minimum: int = 1,
    maximum: int = 60,
) -> int:
    """Seconds a refused client should wait (``Retry-After``), clamped to ``minimum..maximum``.

    ``drain_rate_per_s`` is how fast requests recently left the gateway (completions per second); the
    queue ahead plus this request drains in about ``(queue_len + 1) / rate`` seconds. An unknown or
    zero rate (nothing completing, no healthy instance) gives ``unknown``, e.g. the health check
    interval. Never below ``minimum``: prefill retries are expensive and an immediate retry only
    deepens the queues.
    """
    if drain_rate_per_s > 0 and math.isfinite(drain_rate_per_s):
        seconds = (max(0, queue_len) + 1) / drain_rate_per_s
    else:
        seconds = unknown
    return int(min(maximum, max(minimum, math.ceil(seconds))))
