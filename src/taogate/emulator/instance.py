"""One emulated vLLM instance: config, faults, engine, driver, metrics and stats under one handle.

This is what ``create_emulator_app`` serves and what ``run_fleet`` hands out as ``fleet.instances[i]``:
tests flip ``instance.faults`` and read ``instance.stats()`` in-process, without going over HTTP.
Accounting happens here, in one place: the driver reports engine outputs (first token, tokens, finish)
and the HTTP layer reports the end of each request; both update metrics, stats and the request log.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import random
import time
from typing import Any

from taogate.emulator.clock import Clock, SystemClock
from taogate.emulator.config import EmulatorConfig, Faults
from taogate.emulator.driver import EngineDriver, Tracked
from taogate.emulator.engine import Engine, EngineConfig, SeqOutput
from taogate.emulator.kv_events import KvEventPublisher
from taogate.emulator.metrics import EmulatorMetrics, Finished
from taogate.emulator.stats import RequestRecord, StatsBook
from taogate.emulator.tokenizer import Tokenizer

__all__ = ["EmulatorInstance"]

log = logging.getLogger("taogate.emulator")


class EmulatorInstance:
    """State and accounting of one emulated vLLM server (no HTTP here)."""

    def __init__(self, config: EmulatorConfig, clock: Clock | None = None) -> None:
        self.config = config
        self.clock: Clock = clock or SystemClock()
        self.faults: Faults = config.faults.copy()
        self.created = int(time.time())
        self.engine = Engine(EngineConfig.from_emulator(config))
        self.metrics = EmulatorMetrics(config)
        self.kv_events: KvEventPublisher | None = None
        if config.kv_events_endpoint is not None and config.enable_prefix_caching:
            self.kv_events = KvEventPublisher(
                config.kv_events_endpoint, topic=config.kv_events_topic, replay=config.kv_events_replay
            )
        self.tokenizer = Tokenizer()
        self.book = StatsBook(config.records_kept)
        self.rng = random.Random(config.seed)
        self.driver = EngineDriver(
            self.engine,
            self.clock,
            extra_step_delay=self._fault_delay,
            on_output=self._on_output,
            on_events=self.kv_events.publish if self.kv_events is not None else None,
        )
        self._ids = itertools.count()
        self.closing = asyncio.Event()  # set on shutdown: wakes requests held by the ``hang`` fault
        # Stored Responses (with ``responses_store``): id → (the response, its conversation).
        self.responses: dict[str, tuple[dict[str, Any], list[dict[str, Any]]]] = {}

    # -- public handle ---------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """Snapshot for ``GET /emulator/stats`` (also handy in-process)."""
        return {
            "model": self.config.model,
            "running": self.engine.num_running,
            "waiting": self.engine.num_waiting,
            "kv_cache_usage": self.engine.kv_usage,
            "prefix_cache_queries": self.engine.prefix_queries,
            "prefix_cache_hits": self.engine.prefix_hits,
            **self.book.snapshot(),
        }

    def metrics_text(self) -> bytes:
        e = self.engine
        self.metrics.refresh(
            running=e.num_running,
            waiting=e.reported_waiting,  # as vLLM's gauge: not admitted by the last step
            kv_usage=e.kv_usage,
            prefix_queries=e.prefix_queries,
            prefix_hits=e.prefix_hits,
        )
        return self.metrics.render()

    def start(self) -> None:
        """Background work that needs the running loop (the KV events' replay socket)."""
        if self.kv_events is not None:
            self.kv_events.start()

    async def aclose(self) -> None:
        """Release everything in flight (hung requests get a 503, engine requests are aborted)."""
        self.closing.set()
        await self.driver.aclose()
        if self.kv_events is not None:
            await self.kv_events.aclose()
            self.kv_events = None

    # -- request lifecycle (used by the HTTP layer) ----------------------------------------------

    def new_engine_id(self, request_id: str) -> str:
        # Client-chosen ids may repeat (retries); the engine needs unique ones.
        return f"{request_id}-{next(self._ids)}"

    def begin(self, request_id: str, tag: str | None, kind: str) -> RequestRecord:
        record = RequestRecord(id=request_id, tag=tag, kind=kind, arrival=self.clock.now())
        self.book.begin(record)
        return record

    def end(self, record: RequestRecord) -> None:
        if record.finish is None:
            record.finish = self.clock.now()
        self.book.end(record)
        log.info(
            "request id=%s tag=%s kind=%s status=%d prompt_tokens=%d cached_tokens=%d "
            "completion_tokens=%d finish_reason=%s ttft=%s e2e=%.4f",
            record.id,
            record.tag or "-",
            record.kind,
            record.status,
            record.prompt_tokens,
            record.cached_tokens,
            record.completion_tokens,
            record.finish_reason,
            "-" if record.first_token is None else f"{record.first_token - record.arrival:.4f}",
            record.finish - record.arrival,
        )

    def _fault_delay(self, step: float) -> float:
        """What the faults add to an engine step of ``step`` seconds."""
        return self.faults.latency_spike + step * self.faults.throttle

    def _on_output(self, tracked: Tracked, out: SeqOutput, now: float) -> None:
        record, m = tracked.record, self.metrics
        if out.index == 0 or (out.index is None and out.finish_reason == "stop" and tracked.max_tokens == 0):
            # Prefill done: the prompt counts as processed now (vLLM counts it at the first token).
            m.prompt_tokens.inc(len(tracked.prompt_ids))
            record.cached_tokens += out.num_cached_tokens
            if record.first_token is None:
                record.first_token = now
                m.ttft.observe(now - record.arrival)
        if out.index is not None:
            m.generation_tokens.inc()
            record.completion_tokens += 1
            if tracked.last_token is not None:
                m.itl.observe(now - tracked.last_token)
            tracked.last_token = now
        if out.finish_reason is not None:
            m.finished(self._phases(tracked, out, now))
            record.finish = now
            record.finish_reason = out.finish_reason

    @staticmethod
    def _phases(tracked: Tracked, out: SeqOutput, now: float) -> Finished:
        record = tracked.record
        arrival = record.arrival
        scheduled = tracked.scheduled if tracked.scheduled is not None else now
        first = record.first_token if record.first_token is not None else now
        return Finished(
            reason=out.finish_reason or "stop",
            queued=max(0.0, scheduled - arrival),
            prefill=max(0.0, first - scheduled),
            decode=max(0.0, now - first),
            e2e=now - arrival,
            prompt_tokens=len(tracked.prompt_ids),
            cached_tokens=out.num_cached_tokens,
            generation_tokens=record.completion_tokens,
            max_tokens=tracked.max_tokens,
        )
