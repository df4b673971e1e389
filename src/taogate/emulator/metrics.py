"""vLLM's Prometheus metrics, on a per-instance registry so many emulators share one process.

Names, label names and buckets follow vLLM 0.32: ``model_name`` and ``engine`` (``"0"``, one engine
per instance) on every ``vllm:*`` sample, ``finished_reason`` on successes, ``reason`` on the
waiting-by-reason gauge; ``vllm:cache_config_info`` carries the cache shape in its labels (block
size, block count) and no ``model_name``. prometheus_client appends ``_total`` to counters, so
``Counter("vllm:prompt_tokens")`` is exposed as ``vllm:prompt_tokens_total``, as vLLM serves it.
Gauges are read from the engine at scrape time (``refresh``); counters and the per-request
histograms move as requests finish (``finished``), with the phase times vLLM measures: queued
(arrival to first scheduled), prefill (scheduled to first token), decode (first to last token).
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from taogate.emulator.config import EmulatorConfig

__all__ = ["CONTENT_TYPE", "EmulatorMetrics", "Finished"]

CONTENT_TYPE = "text/plain; version=1.0.0; charset=utf-8"  # what vLLM 0.32's /metrics says
ENGINE = "0"

# vLLM's own bucket boundaries, so dashboards built for vLLM work unchanged.
_TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
    40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
_ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip


def _token_buckets(max_model_len: int) -> tuple[float, ...]:
    """1, 2, 5, 10, 20, 50, ... up to the context length (vLLM's ``request_tokens`` family)."""
    out: list[float] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_model_len:
                return tuple(out)
            out.append(float(m * scale))
        scale *= 10


def _cache_labels(config: EmulatorConfig) -> dict[str, str]:
    """``vllm:cache_config_info``'s labels (all strings, as vLLM writes them)."""
    blocks = config.num_kv_blocks
    tokens = blocks * config.block_size
    return {
        "_block_size_resolved": "True",
        "block_size": str(config.block_size),
        "cache_dtype": "auto",
        "cache_hit_alignment_tokens": "None",
        "effective_attention_block_size": str(config.block_size),
        "enable_mamba_shared_prefix_checkpoint": "False",
        "enable_prefix_caching": str(config.enable_prefix_caching),
        "engine": ENGINE,
        "gpu_memory_utilization": "0.92",
        "hash_block_size": "None",
        "is_attention_free": "False",
        "kv_cache_dtype_skip_layers": "[]",
        "kv_cache_layout": "None",
        "kv_cache_max_concurrency": str(round(tokens / config.max_model_len, 2)),
        "kv_cache_memory_bytes": "None",
        "kv_cache_size_tokens": str(tokens),
        "kv_offloading_backend": "native",
        "kv_offloading_size": "None",
        "kv_sharing_fast_prefill": "False",
        "mamba_block_size": "None",
        "mamba_cache_dtype": "auto",
        "mamba_cache_mode": "none",
        "mamba_page_size_padded": "None",
        "mamba_ssm_cache_dtype": "float32",
        "num_cpu_blocks": "None",
        "num_gpu_blocks": str(blocks),
        "num_gpu_blocks_override": str(config.num_gpu_blocks_override),
        "prefix_cache_retention_interval": "0",
        "prefix_caching_hash_algo": "sha256",
        "prefix_match_unit": "None",
        "replayssm_buffer_len": "16",
        "skip_page_size_padded": "None",
        "sliding_window": "None",
        "swa_bounded_replay": "True",
        "use_kda_recoverssm": "False",
        "use_replayssm": "False",
        "user_specified_block_size": "False",
    }


@dataclass(frozen=True, slots=True)
class Finished:
    """One finished request's phases (seconds) and token counts, as vLLM records them."""

    reason: str
    queued: float
    prefill: float
    decode: float
    e2e: float
    prompt_tokens: int
    cached_tokens: int
    generation_tokens: int
    max_tokens: int


class EmulatorMetrics:
    """The metric objects of one instance, pre-bound to its ``model_name`` and ``engine`` labels."""

    def __init__(self, config: EmulatorConfig) -> None:
        self.registry = r = CollectorRegistry(auto_describe=False)
        model = config.model
        labels = ["model_name", "engine"]
        bound = (model, ENGINE)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=r)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, registry=r)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=r)

        self._running = gauge("vllm:num_requests_running", "Number of requests in model execution batches.")
        self._waiting = gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        self._waiting_by = Gauge(
            "vllm:num_requests_waiting_by_reason",
            "Number of waiting requests by reason.",
            [*labels, "reason"],
            registry=r,
        )
        self._kv = gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        if config.cache_config_info:
            Gauge(
                "vllm:cache_config_info",
                "Information of the LLMEngine CacheConfig",
                list(_cache_labels(config)),
                registry=r,
            ).labels(**_cache_labels(config)).set(1.0)
        self._pc_queries = counter(
            "vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens."
        ).labels(*bound)
        self._pc_hits = counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."
        ).labels(*bound)
        self._preemptions = counter(
            "vllm:num_preemptions", "Cumulative number of preemption from the engine."
        )
        self._preemptions.labels(*bound)
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.").labels(
            *bound
        )
        self._cached = counter(
            "vllm:prompt_tokens_cached", "Number of cached prompt tokens (local + external)."
        ).labels(*bound)
        self.generation_tokens = counter(
            "vllm:generation_tokens", "Number of generation tokens processed."
        ).labels(*bound)
        self._success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            [*labels, "finished_reason"],
            registry=r,
        )
        tokens = _token_buckets(config.max_model_len)
        self.ttft = histogram(
            "vllm:time_to_first_token_seconds", "Time to first token.", _TTFT_BUCKETS
        ).labels(*bound)
        self.itl = histogram("vllm:inter_token_latency_seconds", "Inter-token latency.", _ITL_BUCKETS).labels(
            *bound
        )
        self._hist = {
            name: histogram(f"vllm:{name}", doc, buckets).labels(*bound)
            for name, doc, buckets in (
                ("e2e_request_latency_seconds", "End-to-end request latency.", _LATENCY_BUCKETS),
                ("request_queue_time_seconds", "Time spent in WAITING phase for request.", _LATENCY_BUCKETS),
                (
                    "request_inference_time_seconds",
                    "Time spent in RUNNING phase for request.",
                    _LATENCY_BUCKETS,
                ),
                (
                    "request_prefill_time_seconds",
                    "Time spent in PREFILL phase for request.",
                    _LATENCY_BUCKETS,
                ),
                ("request_decode_time_seconds", "Time spent in DECODE phase for request.", _LATENCY_BUCKETS),
                ("request_time_per_output_token_seconds", "Time per output token per request.", _ITL_BUCKETS),
                ("request_prompt_tokens", "Number of prefill tokens processed.", tokens),
                ("request_generation_tokens", "Number of generation tokens processed.", tokens),
                ("request_params_max_tokens", "Histogram of the max_tokens request parameter.", tokens),
                (
                    "request_prefill_kv_computed_tokens",
                    "Histogram of new KV tokens computed during prefill (excluding cached tokens).",
                    tokens,
                ),
            )
        }
        self._bound = bound
        # Pre-create the children so every series exists (at 0) from the first scrape, as in vLLM.
        for reason in ("stop", "length", "abort", "error", "repetition"):
            self._success.labels(*bound, reason)
        self._seen_queries = 0
        self._seen_hits = 0

    def finished(self, done: Finished) -> None:
        """A request ended: its finish reason and, unless the client went away, its phase times.

        vLLM does not count a client's disconnect as ``finished_reason="abort"`` (that label is for
        aborts inside the engine), so an abort moves nothing here."""
        if done.reason == "abort":
            return
        self._success.labels(*self._bound, done.reason).inc()
        h = self._hist
        h["e2e_request_latency_seconds"].observe(done.e2e)
        h["request_queue_time_seconds"].observe(done.queued)
        h["request_prefill_time_seconds"].observe(done.prefill)
        h["request_decode_time_seconds"].observe(done.decode)
        h["request_inference_time_seconds"].observe(done.prefill + done.decode)
        if done.generation_tokens > 1:
            h["request_time_per_output_token_seconds"].observe(done.decode / (done.generation_tokens - 1))
        h["request_prompt_tokens"].observe(done.prompt_tokens)
        h["request_generation_tokens"].observe(done.generation_tokens)
        h["request_params_max_tokens"].observe(done.max_tokens)
        h["request_prefill_kv_computed_tokens"].observe(done.prompt_tokens - done.cached_tokens)
        self._cached.inc(done.cached_tokens)

    def refresh(
        self, *, running: int, waiting: int, kv_usage: float, prefix_queries: int, prefix_hits: int
    ) -> None:
        """Copy the engine's current state into the gauges and prefix-cache counters."""
        b = self._bound
        self._running.labels(*b).set(running)
        self._waiting.labels(*b).set(waiting)
        self._waiting_by.labels(*b, "capacity").set(waiting)
        self._waiting_by.labels(*b, "deferred").set(0)
        self._kv.labels(*b).set(kv_usage)
        # The engine keeps running totals; counters only move forward by the difference.
        if prefix_queries > self._seen_queries:
            self._pc_queries.inc(prefix_queries - self._seen_queries)
            self._seen_queries = prefix_queries
        if prefix_hits > self._seen_hits:
            self._pc_hits.inc(prefix_hits - self._seen_hits)
            self._seen_hits = prefix_hits

    def render(self) -> bytes:
        return generate_latest(self.registry)
