"""The real-time driver: runs the pure ``Engine`` step loop on asyncio and feeds per-request queues.

Loop: ``plan = engine.schedule()``; wait ``plan.duration`` (+ the ``latency_spike`` and ``throttle``
faults) on the injected clock; ``engine.update(plan)``; put each output on its request's queue.
Requests that arrive mid-step join at the next step boundary, as in vLLM. Waits are deadline-based
so asyncio's small oversleeps do not add up over hundreds of decode steps.

Aborts (client gone, stop string hit, shutdown) free the engine slot at once and put a final output
with the abort's reason on the queue, so whoever reads the queue always sees exactly one finish.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from taogate.emulator.clock import Clock
from taogate.emulator.engine import Engine, EngineRequest, FinishReason, SeqOutput
from taogate.emulator.stats import RequestRecord

__all__ = ["EngineDriver", "Tracked"]

log = logging.getLogger("taogate.emulator")

# At most this much oversleep of one step is caught up by shortening the next.
_MAX_CATCHUP_S = 0.005


@dataclass(slots=True, eq=False)
class Tracked:
    """An engine request in flight: its ids, its record, and the queue its outputs arrive on."""

    engine_id: str
    prompt_ids: Sequence[int]
    max_tokens: int
    record: RequestRecord
    queue: asyncio.Queue[SeqOutput] = field(default_factory=asyncio.Queue)
    scheduled: float | None = None  # when its first prefill chunk was scheduled (vLLM's SCHEDULED)
    last_token: float | None = None  # when its latest token came out (inter-token latency)


OutputHook = Callable[[Tracked, SeqOutput, float], None]
EventsHook = Callable[[list[dict[str, Any]]], None]


class EngineDriver:
    """Owns the step-loop task of one instance; started lazily on the first submit."""

    def __init__(
        self,
        engine: Engine,
        clock: Clock,
        *,
        extra_step_delay: Callable[[float], float],
        on_output: OutputHook,
        on_events: EventsHook | None = None,
    ) -> None:
        self._engine = engine
        self._clock = clock
        self._extra = extra_step_delay
        self._on_output = on_output
        self._on_events = on_events
        self._live: dict[str, Tracked] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._closed = False

    @property
    def live(self) -> int:
        return len(self._live)

    def submit(self, tracked: Tracked) -> None:
        """Queue a request in the engine; raises ``ValueError`` if the engine refuses it."""
        if self._closed:
            raise RuntimeError("emulator is shutting down")
        self._engine.add(EngineRequest(tracked.engine_id, tracked.prompt_ids, tracked.max_tokens))
        self._live[tracked.engine_id] = tracked
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run(), name="emulator-engine")
        self._wake.set()

    def abort(self, engine_id: str, reason: FinishReason = "abort") -> bool:
        """End a request now (freeing its slot and KV); ``False`` if it already finished."""
        tracked = self._live.pop(engine_id, None)
        if tracked is None:
            return False
        self._engine.abort(engine_id)
        self._deliver(tracked, SeqOutput(engine_id, None, reason, tracked.record.cached_tokens))
        return True

    async def aclose(self) -> None:
        """Abort everything in flight and stop the loop task (idempotent)."""
        self._closed = True
        for engine_id in list(self._live):
            self.abort(engine_id)
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def _deliver(self, tracked: Tracked, out: SeqOutput) -> None:
        self._on_output(tracked, out, self._clock.now())
        tracked.queue.put_nowait(out)

    async def _run(self) -> None:
        try:
            await self._loop()
        except asyncio.CancelledError:
            raise
        except Exception:
            # A bug in the model must not leave clients hanging: fail what is in flight, log loudly.
            log.exception("emulator engine loop crashed; aborting %d request(s)", len(self._live))
            for engine_id in list(self._live):
                self.abort(engine_id)

    async def _loop(self) -> None:
        engine, clock = self._engine, self._clock
        deadline = clock.now()
        while True:
            plan = engine.schedule()
            if plan is None:
                self._wake.clear()
                await self._wake.wait()
                deadline = clock.now()
                continue
            now = clock.now()
            for rid, _ in plan.prefill:
                started = self._live.get(rid)
                if started is not None and started.scheduled is None:
                    started.scheduled = now
            deadline = max(deadline, now - _MAX_CATCHUP_S) + plan.duration + self._extra(plan.duration)
            await clock.sleep(deadline - now)
            outputs = engine.update(plan)
            if self._on_events is not None:  # a step's KV events go out after its forward, as vLLM's
                self._on_events(engine.take_events())
            for out in outputs:
                tracked = self._live.get(out.request_id)
                if tracked is None:
                    continue
                if out.finish_reason is not None:
                    del self._live[out.request_id]
                self._deliver(tracked, out)
