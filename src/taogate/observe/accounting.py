"""After a request: learn from what the instance reported (``fleet.learning``), then account.

Accounting updates the metrics once per request, the instance's last-minute window, and writes the
one structured log line. Nothing here runs inside the dispatch decision.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

from taogate.dispatch.calibration import TokenEstimator
from taogate.dispatch.speed import SpeedEstimator
from taogate.dispatch.tokens import PromptSize
from taogate.dispatch.types import RequestFacts
from taogate.fleet.fleet import Fleet
from taogate.fleet.instance import Instance
from taogate.fleet.learning import Learning
from taogate.fleet.lease import Lease
from taogate.observe.access_log import AccessLog
from taogate.observe.metrics import GatewayMetrics, priority_label
from taogate.request_record import RequestRecord


@dataclass(slots=True)
class Accounting:
    metrics: GatewayMetrics
    fleet: Fleet
    tokens: TokenEstimator
    speeds: SpeedEstimator
    access: AccessLog
    clock: Callable[[], float]
    long_tag: str
    _learning: Learning = field(init=False)

    def __post_init__(self) -> None:
        self._learning = Learning(self.tokens, self.speeds, self.clock)

    def reloaded(self, access: AccessLog, long_tag: str) -> Accounting:
        """A new config's accounting, with this one's learning (when each model last calibrated)."""
        new = replace(self, access=access, long_tag=long_tag)
        new._learning = self._learning
        return new

    def learn(self, rec: RequestRecord, facts: RequestFacts, size: PromptSize, lease: Lease) -> None:
        """Calibrate the token estimate and the instance's speed from a successful response."""
        self._learning.learn(rec, facts, size, lease)

    def waited(self, rec: RequestRecord, seconds: float) -> None:
        """Time the request spent in the gateway queue, granted a slot or not."""
        rec.queue_wait += seconds
        self.metrics.queue_wait.observe(seconds)

    def attempt_failed(self, inst: Instance, blame: bool) -> None:
        """An attempt retried elsewhere: a request in the instance's last-minute window, an error
        when it was the instance's fault (the request itself is accounted where it ends)."""
        inst.window.record(self.clock(), ok=not blame, prompt_tokens=0, completion_tokens=0, ttft=None)

    def record(self, rec: RequestRecord) -> None:
        """Metrics, the instance's window and the access log line: once per request, every path."""
        now = self.clock()
        rec.duration = now - rec.started
        m = self.metrics
        child = m.child
        name = rec.instance
        instance = name or "none"
        tag = self.long_tag if rec.long else "none"
        model = rec.model if rec.model is not None and rec.model in self.fleet.models else "unknown"
        status = rec.status
        status_class = _STATUS_CLASSES.get(status // 100) or f"{status // 100}xx"
        series = m.series(rec.route, model, instance, status_class, tag)
        series.requests.inc()
        priority = priority_label(rec.priority or 0)
        child(m.priority_requests, priority, status_class).inc()
        if rec.queue_wait:
            child(m.priority_queue_wait, priority).observe(rec.queue_wait)
        if rec.reject is not None:
            child(m.rejections, rec.reject).inc()
        if rec.channel_fallback:
            child(m.channel_fallbacks, "long" if rec.long else "short").inc()
        if name is not None:
            series.duration.observe(rec.duration)
            if rec.ttfb is not None:
                series.ttfb.observe(rec.ttfb)
            if rec.prompt_tokens is not None:
                series.prompt_usage.inc(rec.prompt_tokens)
            elif rec.prompt_tokens_est is not None and status < 300:
                series.prompt_estimate.inc(rec.prompt_tokens_est)
            if rec.completion_tokens:
                series.completion.inc(rec.completion_tokens)
            inst = self.fleet.find(name)
            if inst is not None:
                inst.window.record(
                    now,
                    ok=status < 500,
                    prompt_tokens=rec.prompt_tokens or rec.prompt_tokens_est or 0,
                    completion_tokens=rec.completion_tokens or 0,
                    ttft=rec.ttfb if rec.stream else None,  # a whole answer's first byte is its last
                )
        self.access.emit(rec)


#: ``"2xx"`` and the like, for the status classes HTTP has.
_STATUS_CLASSES = {n: f"{n}xx" for n in range(1, 6)}
