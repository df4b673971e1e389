"""After a request: learn from what the instance reported, then account at the edges.

Learning calibrates the prompt-size estimate (``usage.prompt_tokens``) and the instance's speed
(TTFT over the prefill work it really did). Accounting updates the metrics once per request, the
instance's last-minute window, and writes the one structured log line. Nothing here runs inside the
dispatch decision.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from taogate.dispatch.speed import SpeedEstimator
from taogate.dispatch.tokens import PromptSize, TokenEstimator
from taogate.dispatch.types import EngineStats, RequestFacts
from taogate.fleet.fleet import Fleet
from taogate.fleet.instance import Instance
from taogate.fleet.lease import Lease
from taogate.observe.access_log import AccessLog, RequestRecord
from taogate.observe.metrics import GatewayMetrics, priority_label

#: The token estimate converges within a few dozen observations per model; past that, a model's
#: estimate learns from at most one response per this many seconds: its least-squares update is the
#: costliest step after a response (measured: benchmarks/overhead.py). Slow traffic still calibrates
#: from every response.
CALIBRATE_WARMUP = 64
CALIBRATE_INTERVAL = 0.05


def waiting_for_slots(inst: Instance, engine: EngineStats | None) -> bool:
    """The engine (``engine``: its stats while trusted) has requests waiting while every sequence
    it runs is past its prefill: they wait for a batch slot (``max_num_seqs``) held by decodes,
    which no booked prefill work explains. (With a sequence still prefilling, the wait is for the
    step's token budget: booked work, that is.)"""
    if engine is None or engine.waiting <= 0:
        return False
    return inst.inflight - inst.prefilling >= engine.running


@dataclass(slots=True)
class Accounting:
    metrics: GatewayMetrics
    fleet: Fleet
    tokens: TokenEstimator
    speeds: SpeedEstimator
    access: AccessLog
    clock: Callable[[], float]
    long_tag: str
    _calibrated: dict[str, float] = field(default_factory=dict)  # model → when it last learned

    def learn(self, rec: RequestRecord, facts: RequestFacts, size: PromptSize, lease: Lease) -> None:
        """Calibrate the token estimate and the instance's speed from a successful response."""
        prompt, completion, cached = rec.prompt_tokens, rec.completion_tokens, rec.cached_tokens
        lease.cached = cached  # what the engine found cached, for the instance's cache model
        model = facts.model
        if prompt is not None and model is not None:
            now = self.clock()
            tokens = self.tokens
            last = self._calibrated.get(model)
            due = last is None or now - last >= CALIBRATE_INTERVAL
            if due or tokens.observations(model) < CALIBRATE_WARMUP:
                tokens.observe(model, size, prompt)
                self._calibrated[model] = now
                if len(self._calibrated) > len(tokens):  # models the estimator has evicted
                    self._calibrated = {m: t for m, t in self._calibrated.items() if tokens.observations(m)}
        if rec.ttfb is None:
            return
        inst = lease.instance
        name = inst.name
        total = prompt if prompt is not None else facts.prompt_tokens
        uncached = max(1, total - (cached or 0))
        if facts.stream:
            details = cached is not None
            engine = inst.engine_stats(self.clock())
            self.speeds.observe_first_token(
                name,
                ttft=rec.ttfb,
                ahead_tokens=lease.ahead_tokens,
                uncached_tokens=uncached if details else None,
                prompt_tokens=total,
                queued=waiting_for_slots(inst, engine),
                hold=engine is not None,  # its next window is coming
            )
            if completion:  # the decode pace, which non-stream samples need to find their prefill time
                self.speeds.observe_completion(
                    name,
                    duration=self.clock() - rec.started - rec.queue_wait,
                    completion_tokens=completion,
                    ahead_tokens=lease.ahead_tokens,
                    uncached_tokens=uncached,
                    prompt_tokens=total,
                    ttft=rec.ttfb,
                )
        else:
            self.speeds.observe_completion(
                name,
                duration=rec.ttfb,
                completion_tokens=completion or 0,
                ahead_tokens=lease.ahead_tokens,
                uncached_tokens=uncached,
                prompt_tokens=total,
            )

    def record(self, rec: RequestRecord) -> None:
        """Metrics, the instance's window and the access log line: once per request, every path."""
        now = self.clock()
        rec.duration = now - rec.started
        m = self.metrics
        child = m.child
        instance = rec.instance or "none"
        tag = self.long_tag if rec.long else "none"
        model = rec.model if rec.model is not None and rec.model in self.fleet.models else "unknown"
        status_class = f"{rec.status // 100}xx"
        child(m.requests, rec.route, model, instance, status_class, tag).inc()
        priority = priority_label(rec.priority or 0)
        child(m.priority_requests, priority, status_class).inc()
        if rec.queue_wait:
            child(m.priority_queue_wait, priority).observe(rec.queue_wait)
        if rec.reject is not None:
            child(m.rejections, rec.reject).inc()
        if rec.channel_fallback:
            child(m.channel_fallbacks, "long" if rec.long else "short").inc()
        if rec.instance is not None:
            child(m.duration, rec.route, instance, tag).observe(rec.duration)
            if rec.ttfb is not None:
                child(m.ttfb, rec.route, instance, tag).observe(rec.ttfb)
            if rec.prompt_tokens is not None:
                child(m.prompt_tokens, instance, tag, "usage").inc(rec.prompt_tokens)
            elif rec.prompt_tokens_est is not None and rec.status < 300:
                child(m.prompt_tokens, instance, tag, "estimate").inc(rec.prompt_tokens_est)
            if rec.completion_tokens:
                child(m.completion_tokens, instance).inc(rec.completion_tokens)
            inst = self.fleet.find(rec.instance)
            if inst is not None:
                inst.window.record(
                    now,
                    ok=rec.status < 500,
                    prompt_tokens=rec.prompt_tokens or rec.prompt_tokens_est or 0,
                    completion_tokens=rec.completion_tokens or 0,
                    ttft=rec.ttfb,
                )
        self.access.emit(rec)
