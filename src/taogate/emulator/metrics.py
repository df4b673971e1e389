"""vLLM's Prometheus metrics, on a per-instance registry so many emulators share one process.

Names and label sets follow vLLM v1 (``model_name`` on everything, ``finished_reason`` on successes).
prometheus_client appends ``_total`` to counters, so ``Counter("vllm:prompt_tokens")`` is exposed as
``vllm:prompt_tokens_total``, matching what vLLM serves. Gauges are read from the engine at scrape time
(see ``refresh``) so they are never stale; counters and histograms move as requests progress.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

if TYPE_CHECKING:
    from taogate.emulator.config import EmulatorConfig

__all__ = ["CONTENT_TYPE", "EmulatorMetrics"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# vLLM's own bucket boundaries, so dashboards built for vLLM work unchanged.
_TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
_E2E_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
    40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip


class EmulatorMetrics:
    """The metric objects of one instance, pre-bound to its ``model_name`` label."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        labels = ["model_name"]
        r = self.registry
        self._running = Gauge("vllm:num_requests_running", "Requests in the model batch.", labels, registry=r)
        self._waiting = Gauge(
            "vllm:num_requests_waiting", "Requests waiting to be processed.", labels, registry=r
        )
        self._kv = Gauge(
            "vllm:kv_cache_usage_perc", "KV-cache usage; 1 means 100 percent.", labels, registry=r
        )
        self._pc_queries = Counter(
            "vllm:prefix_cache_queries", "Prefix cache queries, in queried tokens.", labels, registry=r
        )
        self._pc_hits = Counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in cached tokens.", labels, registry=r
        )
        self.prompt_tokens = Counter(
            "vllm:prompt_tokens", "Prefill tokens processed.", labels, registry=r
        ).labels(model_name)
        self.generation_tokens = Counter(
            "vllm:generation_tokens", "Generation tokens processed.", labels, registry=r
        ).labels(model_name)
        self._success = Counter(
            "vllm:request_success", "Finished requests.", [*labels, "finished_reason"], registry=r
        )
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Time to first token.",
            labels,
            buckets=_TTFT_BUCKETS,
            registry=r,
        ).labels(model_name)
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "End-to-end request latency.",
            labels,
            buckets=_E2E_BUCKETS,
            registry=r,
        ).labels(model_name)
        self._model = model_name
        # Pre-create the children so every series exists (at 0) from the first scrape, as in vLLM.
        for reason in ("stop", "length", "abort"):
            self._success.labels(model_name, reason)
        self._pc_queries_child = self._pc_queries.labels(model_name)
        self._pc_hits_child = self._pc_hits.labels(model_name)
        self._seen_queries = 0
        self._seen_hits = 0

    def cache_config(self, config: EmulatorConfig) -> None:
        """``vllm:cache_config_info``: the KV cache's shape as labels (vLLM has every CacheConfig
        field; these are the ones a router reads), value 1."""
        labels = {
            "block_size": str(config.block_size),
            "enable_prefix_caching": str(config.enable_prefix_caching),
            "engine": "0",
            "num_gpu_blocks": str(config.num_kv_blocks),
            "num_gpu_blocks_override": str(config.num_gpu_blocks_override),
            "prefix_caching_hash_algo": "sha256",
        }
        info = Gauge(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            list(labels),
            registry=self.registry,
        )
        info.labels(**labels).set(1)

    def finished(self, reason: str) -> None:
        self._success.labels(self._model, reason).inc()

    def refresh(
        self, *, running: int, waiting: int, kv_usage: float, prefix_queries: int, prefix_hits: int
    ) -> None:
        """Copy the engine's current state into the gauges and prefix-cache counters."""
        self._running.labels(self._model).set(running)
        self._waiting.labels(self._model).set(waiting)
        self._kv.labels(self._model).set(kv_usage)
        # The engine keeps running totals; counters only move forward by the difference.
        if prefix_queries > self._seen_queries:
            self._pc_queries_child.inc(prefix_queries - self._seen_queries)
            self._seen_queries = prefix_queries
        if prefix_hits > self._seen_hits:
            self._pc_hits_child.inc(prefix_hits - self._seen_hits)
            self._seen_hits = prefix_hits

    def render(self) -> bytes:
        return generate_latest(self.registry)
