"""The last few minutes of the fleet, one frame a second, for the dashboard's charts.

A person looking at a slow card wants to see its line diverge from the others', which one glance at
the current figures cannot show. The gateway keeps the frames in one bounded ring (``capacity``
frames, whatever the traffic; an instance that leaves the fleet ages out with its frames), sampled
from the live objects and the metric registry, so the request path does not pay for it.
Counters are kept cumulative in the frames and turned into rates and recent counts when read.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from taogate.fleet.dispatcher import Dispatcher
    from taogate.fleet.fleet import Fleet
    from taogate.observe.metrics import GatewayMetrics

__all__ = ["HISTORY_INTERVAL", "HISTORY_SECONDS", "Frame", "History", "Point", "counter_totals", "sample"]

HISTORY_INTERVAL = 1.0  # seconds between frames
HISTORY_SECONDS = 300  # frames kept: five minutes at one a second
RECENT_SECONDS = 60.0  # "recent" rejections and retries
RATE_FRAMES = 5  # requests/s over this many frames: answers come in bursts, one-frame rates alias


@dataclass(frozen=True, slots=True)
class Point:
    """One instance in one frame."""

    inflight: int
    waiting: float | None  # the engine's own queue at the last scrape
    ttft_p99: float | None  # over the instance's last minute
    requests: float  # answered so far (cumulative: rates come from two frames)


@dataclass(frozen=True, slots=True)
class Frame:
    at: float  # the gateway's clock
    queued: int  # in the gateway queue
    instances: Mapping[str, Point]
    rejections: Mapping[str, float]  # cumulative, by reason
    retries: Mapping[str, float]  # cumulative, by reason of the failed attempt


def counter_totals(counter: Collector, label: str) -> dict[str, float]:
    """A labelled counter's values summed by one of its labels."""
    out: dict[str, float] = {}
    for family in counter.collect():
        for s in family.samples:
            if s.name.endswith("_total"):
                key = s.labels[label]
                out[key] = out.get(key, 0.0) + s.value
    return out


def sample(fleet: Fleet, dispatcher: Dispatcher, metrics: GatewayMetrics, now: float) -> Frame:
    """One frame from the live objects (in-flight, engine queue, TTFT) and the registry (counters)."""
    answered = counter_totals(metrics.requests, "instance")
    points = {}
    for inst in fleet:
        engine = inst.engine
        points[inst.name] = Point(
            inflight=inst.inflight,
            waiting=engine.waiting if engine is not None else None,
            ttft_p99=inst.window.stats(now).ttft_p99,
            requests=answered.get(inst.name, 0.0),
        )
    return Frame(
        at=now,
        queued=dispatcher.queued,
        instances=points,
        rejections=counter_totals(metrics.rejections, "reason"),
        retries=counter_totals(metrics.retries, "reason"),
    )


def _delta(new: Mapping[str, float], old: Mapping[str, float]) -> dict[str, int]:
    out = {}
    for key, value in new.items():
        d = round(value - old.get(key, 0.0))
        if d > 0:
            out[key] = d
    return dict(sorted(out.items()))


def _rate(frames: list[Frame], i: int, name: str) -> float | None:
    """Requests/s of ``name`` at frame ``i``, from the oldest of the ``RATE_FRAMES`` frames before
    it that has the instance."""
    cur = frames[i]
    prev = next((f for f in frames[max(0, i - RATE_FRAMES) : i] if name in f.instances), None)
    if prev is None:
        return None
    d = cur.instances[name].requests - prev.instances[name].requests
    return round(d / (cur.at - prev.at), 2) if d >= 0 else None  # < 0: its series were reset


def _r(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


class History:
    """The ring of frames: appended by the gateway's sampler, read by the admin endpoints."""

    def __init__(self, capacity: int = HISTORY_SECONDS, interval: float = HISTORY_INTERVAL) -> None:
        if capacity < 1:
            raise ValueError("capacity must be at least 1")
        self.capacity = capacity
        self.interval = interval
        self._frames: deque[Frame] = deque(maxlen=capacity)

    def __len__(self) -> int:
        return len(self._frames)

    def add(self, frame: Frame) -> None:
        """Append a frame; one older than the newest is refused (times only go forward)."""
        if self._frames and frame.at <= self._frames[-1].at:
            return
        self._frames.append(frame)

    def recent(self, seconds: float = RECENT_SECONDS) -> tuple[dict[str, int], dict[str, int]]:
        """(rejections, retries) by reason over the last ``seconds`` of frames (fewer while the ring
        is younger than that)."""
        if not self._frames:
            return {}, {}
        last = self._frames[-1]
        base = self._frames[0]
        for frame in self._frames:
            if frame.at > last.at - seconds:
                break
            base = frame
        return _delta(last.rejections, base.rejections), _delta(last.retries, base.retries)

    def payload(self, since: float | None = None) -> dict[str, Any]:
        """The frames newer than ``since`` (all of them when None), as one series per figure."""
        frames = list(self._frames)
        stamps = [round(f.at, 3) for f in frames]  # as sent: ``since`` is one of them
        start = 0 if since is None else bisect.bisect_right(stamps, since)
        names: dict[str, None] = {}
        for frame in frames[start:]:
            names.update(dict.fromkeys(frame.instances))
        series: dict[str, dict[str, list[float | int | None]]] = {
            n: {"inflight": [], "waiting": [], "ttft_p99": [], "rps": []} for n in names
        }
        for i in range(start, len(frames)):
            cur = frames[i]
            for name, s in series.items():
                point = cur.instances.get(name)
                s["inflight"].append(point.inflight if point else None)
                s["waiting"].append(point.waiting if point else None)
                s["ttft_p99"].append(_r(point.ttft_p99) if point else None)
                s["rps"].append(_rate(frames, i, name) if point else None)
        return {
            "interval": self.interval,
            "capacity": self.capacity,
            "rate_frames": RATE_FRAMES,
            "t": stamps[start:],
            "queued": [f.queued for f in frames[start:]],
            "instances": series,
        }
