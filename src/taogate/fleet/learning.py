"""After a successful response: learn the prompt-size estimate and the instance's speed from it.

The token estimate learns from the instance's ``usage.prompt_tokens``; the speed from the TTFT over
the prefill work the instance really did (``SpeedEstimator``). Nothing here runs inside the dispatch
decision; ``observe.accounting`` calls it once per successful generation.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from taogate.dispatch.calibration import TokenEstimator
from taogate.dispatch.speed import SpeedEstimator
from taogate.dispatch.tokens import PromptSize
from taogate.dispatch.types import EngineStats, RequestFacts
from taogate.fleet.instance import Instance
from taogate.fleet.lease import Lease

__all__ = ["CALIBRATE_INTERVAL", "CALIBRATE_WARMUP", "Learning", "Outcome", "waiting_for_slots"]

#: The token estimate converges within a few dozen observations per model; past that, a model's
#: estimate learns from at most one response per this many seconds: its least-squares update is the
#: costliest step after a response (measured: benchmarks/overhead.py). Slow traffic still calibrates
#: from every response.
CALIBRATE_WARMUP = 64
CALIBRATE_INTERVAL = 0.05


class Outcome(Protocol):
    """What a response told (the request's record)."""

    @property
    def prompt_tokens(self) -> int | None: ...
    @property
    def completion_tokens(self) -> int | None: ...
    @property
    def cached_tokens(self) -> int | None: ...
    @property
    def ttfb(self) -> float | None: ...
    @property
    def started(self) -> float: ...
    @property
    def queue_wait(self) -> float: ...


def waiting_for_slots(inst: Instance, engine: EngineStats | None) -> bool:
    """The engine (``engine``: its stats while trusted) has requests waiting while every sequence
    it runs is past its prefill: they wait for a batch slot (``max_num_seqs``) held by decodes,
    which no booked prefill work explains. (With a sequence still prefilling, the wait is for the
    step's token budget: booked work, that is.)"""
    if engine is None or engine.waiting <= 0:
        return False
    return inst.inflight - inst.prefilling >= engine.running


@dataclass(slots=True)
class Learning:
    tokens: TokenEstimator
    speeds: SpeedEstimator
    clock: Callable[[], float]
    _calibrated: dict[str, float] = field(default_factory=dict)  # model → when it last learned

    def learn(self, rec: Outcome, facts: RequestFacts, size: PromptSize, lease: Lease) -> None:
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
        inst = lease.instance
        if rec.ttfb is None or inst.retired:  # a removed instance's speed is forgotten, not relearned
            return
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
