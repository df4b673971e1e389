"""Admission: send a request now (and where), make it wait for a slot, or refuse it.

``decide`` is a pure function of the request's facts and a snapshot of the fleet. It refuses a model
no instance serves (404), keeps the instances that may take the request (healthy, serving the model,
not excluded, in its long/short channel, or the other channel when its own has none at all:
``channel_fallback``), hands those with room to ``policy.choose``, else the overflow instance, else
``Wait`` while anything eligible exists, else ``Refuse("no_instance")`` (503). It is
work-conserving: never ``Wait`` while an eligible instance has room. Each step's reasoning:
benchmarks/README.md, "Design notes moved from the code".
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
    """Send, Wait or Refuse for ``req`` over the fleet snapshot ``views`` (see the module docstring).

    One pass over the views sorts them as ``candidates`` does (it runs for every request); the
    primaries of the other channel are gathered only when the request's own has none."""
    model = req.model
    own = ("long", "any") if req.long else ("short", "any")
    listed = served = False  # some instance has listed its models; some serves this one
    eligible = primary = False  # some usable primary in the request's channel; in any channel
    room: list[InstanceView] = []  # the eligible ones below their cap
    overflow: list[InstanceView] = []
    for v in views:
        models = v.models
        if models:
            listed = True
            if model is not None and model not in models:
                continue
        served = True
        if v.available and v.name not in exclude:
            if v.overflow:
                overflow.append(v)
            else:
                primary = True
                if v.role in own:
                    eligible = True
                    if v.inflight < v.cap:
                        room.append(v)
    if model is not None and listed and not served:
        return Refuse("model_not_found")
    fallback = not eligible and primary
    if fallback:
        eligible = True
        room = [v for v in views if _usable(v, model, exclude) and not v.overflow and v.inflight < v.cap]
    if room:
        send = policy.choose(req, room)
        if send is not None:
            return replace(send, channel_fallback=True) if fallback else send

    spare = [v for v in overflow if v.has_room]
    if spare:
        target = max(spare, key=lambda v: (v.cap - v.inflight, v.name))
        return Send(target.name, "overflow", channel_fallback=fallback)
    if eligible or overflow:
        return Wait()
    return Refuse("no_instance")


def _usable(v: InstanceView, model: str | None, exclude: Collection[str]) -> bool:
    """Available, serving ``model``, not excluded."""
    return v.available and v.serves(model) and v.name not in exclude


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
    usable = [v for v in views if _usable(v, req.model, exclude)]
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
