"""Pure parser of a vLLM instance's Prometheus ``/metrics`` text into one ``EngineSample``.

The scrape loop (``control.scraper``) fetches the text and stamps the time; everything here is
plain data in, plain data out::

    /metrics text ──parse_vllm_metrics──► EngineSample ──┬── running, waiting, kv_usage (gauges)
                                                         ├── counters ──hit_rate(prev, cur)──► 0..1
                                                         └── phase sums ──engine_window(prev, cur)

The engine's gauges count work from every gateway replica, which our own counts cannot see; its
per-request phase histograms, differenced between scrapes, say how fast it prefilled, without slot
waits or the HTTP path. vLLM V1's metric names win, the older ones are the fallback. Text that is not
Prometheus exposition raises ``ScrapeError`` (a ``ValueError``); a missing metric is ``None``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from taogate.dispatch.types import EngineStats

__all__ = [
    "CacheConfig",
    "EngineSample",
    "EngineWindow",
    "ScrapeError",
    "engine_stats",
    "engine_window",
    "hit_rate",
    "is_stale",
    "parse_vllm_metrics",
    "stale_after",
]

RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")  # new name first
PREFIX_QUERIES = ("vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total")
PREFIX_HITS = ("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total")
PROMPT_TOKENS = "vllm:prompt_tokens_total"
GENERATION_TOKENS = "vllm:generation_tokens_total"
REQUEST_SUCCESS = "vllm:request_success_total"
# Per-request phase histograms: their _sum (seconds or tokens) and _count (finished requests).
FINISHED = "vllm:request_prefill_time_seconds_count"
PHASES = {
    "prefill_time": "vllm:request_prefill_time_seconds_sum",
    "queue_time": "vllm:request_queue_time_seconds_sum",
    "decode_time": "vllm:request_decode_time_seconds_sum",
    "computed_tokens": "vllm:request_prefill_kv_computed_tokens_sum",
    "request_prompt_tokens": "vllm:request_prompt_tokens_sum",
    "request_generation_tokens": "vllm:request_generation_tokens_sum",
}
CACHE_CONFIG = "vllm:cache_config_info"

_WANTED = frozenset(
    {
        RUNNING,
        WAITING,
        PROMPT_TOKENS,
        GENERATION_TOKENS,
        REQUEST_SUCCESS,
        FINISHED,
        *PHASES.values(),
        CACHE_CONFIG,
        *KV_USAGE,
        *PREFIX_QUERIES,
        *PREFIX_HITS,
    }
)

# Sample lines start with the name followed by '{' or ' '.
_WANTED_PREFIXES = tuple(f"{name}{sep}" for name in sorted(_WANTED) for sep in ("{", " "))


def _looks_like_exposition(text: str) -> bool:
    """Empty, comments, or ``name[{labels}] value`` lines: a page that just lacks our metrics."""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        rest = line.partition("}")[2] if "{" in line else line.partition(" ")[2]
        value = rest.strip().split(" ", 1)[0]
        try:
            float(value)
        except ValueError:
            return False
        return True
    return True


#: A sample is stale after this many scrape intervals (one or two missed scrapes are normal jitter).
STALE_INTERVALS = 3.0
#: ...and never before this many seconds, so a very short interval does not make every sample stale.
STALE_MIN_SECONDS = 2.0


class ScrapeError(ValueError):
    """The /metrics body is not Prometheus text exposition (e.g. an HTML or JSON error page)."""


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """The KV cache's shape, from ``vllm:cache_config_info``'s labels (for all its engines: vLLM
    writes their total on each engine's row)."""

    num_gpu_blocks: int  # the null block included: one fewer is usable
    block_size: int
    prefix_caching: bool
    hash_algo: str | None = None
    engines: int = 1  # data-parallel engines sharing these blocks

    @property
    def usable_blocks(self) -> int:
        return max(0, self.num_gpu_blocks - 1)

    @property
    def usable_blocks_per_engine(self) -> int:
        """One engine's share: what one KV-events publisher (one rank) can hold."""
        return max(0, self.num_gpu_blocks // max(1, self.engines) - 1)


def _cache_config(labels: dict[str, str]) -> CacheConfig | None:
    try:
        blocks, size = int(labels["num_gpu_blocks"]), int(labels["block_size"])
    except (KeyError, ValueError):
        return None  # "None" before the engine has sized its cache
    if blocks <= 0 or size <= 0:
        return None
    caching = labels.get("enable_prefix_caching", "True").lower() == "true"
    return CacheConfig(blocks, size, caching, labels.get("prefix_caching_hash_algo"))


@functools.lru_cache(maxsize=64)
def _cache_config_line(line: str) -> tuple[dict[str, str], CacheConfig | None]:
    """One ``vllm:cache_config_info`` sample line: its labels and the config they describe.

    Its dozens of labels made it most of a scrape's parse, and an engine writes the same line on
    every scrape: keyed by the raw line, it is parsed once per engine and cache shape (the labels
    are only read, never changed)."""
    labels: dict[str, str] = {}
    for family in text_string_to_metric_families(line + "\n"):
        for sample in family.samples:
            labels = sample.labels
    return labels, _cache_config(labels)


@dataclass(frozen=True, slots=True)
class EngineSample:
    """One scrape of one instance, summed over its engines (data-parallel ranks).

    Gauges are current values; counters are cumulative since the instance started, so only their
    differences between two samples mean anything (see ``hit_rate``). ``None``: not exposed.
    """

    running: float | None = None
    waiting: float | None = None
    kv_usage: float | None = None  # 0..1, mean over engines
    prefix_queries: float | None = None  # tokens looked up in the prefix cache (counter)
    prefix_hits: float | None = None  # tokens found there (counter)
    prompt_tokens: float | None = None  # counter
    generation_tokens: float | None = None  # counter
    request_success: float | None = None  # counter, all finish reasons
    finished: float | None = None  # requests whose phases are in the sums below (counter)
    prefill_time: float | None = None  # Σ seconds from first scheduled to first token
    queue_time: float | None = None  # Σ seconds waiting to be scheduled
    decode_time: float | None = None  # Σ seconds from first to last token
    computed_tokens: float | None = None  # Σ prompt tokens prefilled (cache hits excluded)
    request_prompt_tokens: float | None = None  # Σ prompt tokens, cache hits included
    request_generation_tokens: float | None = None  # Σ output tokens
    engines: int = 0  # distinct engine label values seen (1 when unlabelled)
    cache_config: CacheConfig | None = None  # None: not exposed (older vLLM, other servers)

    @property
    def has_load(self) -> bool:
        """Both queue gauges are known: enough for dispatch to use this sample."""
        return self.running is not None and self.waiting is not None


def parse_vllm_metrics(text: str, model: str | None = None) -> EngineSample:
    """Parse vLLM's /metrics text; with ``model``, keep only samples labelled with that model_name.

    Samples without a ``model_name`` label are kept even when ``model`` is given (older vLLM and
    unlabelled exporters). Pass ``None`` for the whole instance's load: the GPU is shared by whatever
    it serves (LoRA adapters are reported under the base model's name), so that is what dispatch
    should weigh.
    """
    sums: dict[str, float] = {}
    kv: dict[str, list[float]] = {}
    engines: set[str] = set()
    configs: dict[str, CacheConfig] = {}
    # Parse only the lines of the wanted metrics: a real vLLM page is mostly histogram buckets we
    # ignore, and the full parse costs milliseconds per scrape per instance (measured:
    # benchmarks/README.md).
    lines = [line for line in text.splitlines() if line.startswith(_WANTED_PREFIXES)]
    if not lines and not _looks_like_exposition(text):
        snippet = text[:80].replace("\n", "\\n")
        raise ScrapeError(f"not Prometheus text exposition: {snippet!r}")
    infos = [line for line in lines if line.startswith(CACHE_CONFIG)]
    kept = "\n".join(line for line in lines if not line.startswith(CACHE_CONFIG))
    try:
        for line in infos:
            labels, found = _cache_config_line(line)
            if model is not None and labels.get("model_name", model) != model:
                continue
            if found is not None:
                configs[labels.get("engine", "")] = found
        for family in text_string_to_metric_families(kept + "\n" if kept else ""):
            # Match on the sample name: the parser strips ``_total`` from counter *family* names
            # (and older clients emit ``_created`` samples in the same family), sample names keep it.
            for sample in family.samples:
                name = sample.name
                if name not in _WANTED:
                    continue
                labels = sample.labels
                if model is not None and labels.get("model_name", model) != model:
                    continue
                value = float(sample.value)
                if not math.isfinite(value):
                    continue  # NaN/Inf carries no information; leave the field as missing
                engines.add(labels.get("engine", ""))
                if name in KV_USAGE:
                    kv.setdefault(name, []).append(value)
                else:
                    sums[name] = sums.get(name, 0.0) + value
    except Exception as exc:  # the parser raises ValueError, IndexError, ... on non-exposition text
        snippet = text[:80].replace("\n", "\\n")
        raise ScrapeError(f"not Prometheus text exposition ({exc}): {snippet!r}") from exc

    return EngineSample(
        running=sums.get(RUNNING),
        waiting=sums.get(WAITING),
        kv_usage=_kv_usage(kv),
        prefix_queries=_first(sums, PREFIX_QUERIES),
        prefix_hits=_first(sums, PREFIX_HITS),
        prompt_tokens=sums.get(PROMPT_TOKENS),
        generation_tokens=sums.get(GENERATION_TOKENS),
        request_success=sums.get(REQUEST_SUCCESS),
        finished=sums.get(FINISHED),
        engines=len(engines),
        **{field: sums.get(name) for field, name in PHASES.items()},
        cache_config=_merge_configs(list(configs.values())),
    )


def _merge_configs(configs: list[CacheConfig]) -> CacheConfig | None:
    """One instance's cache over its data-parallel engines. vLLM's API process sums the engines'
    ``num_gpu_blocks`` at their handshake and writes that total on every engine's row, so the
    rows are not summed again; their count is the number of engines."""
    if not configs:
        return None
    first = configs[0]
    blocks = max(c.num_gpu_blocks for c in configs)
    return CacheConfig(blocks, first.block_size, first.prefix_caching, first.hash_algo, len(configs))


def _first(values: dict[str, float], names: Iterable[str]) -> float | None:
    for name in names:
        if name in values:
            return values[name]
    return None


def _kv_usage(kv: dict[str, list[float]]) -> float | None:
    # Mean, not max: data-parallel engines of one instance have equal-sized caches and the instance's
    # own API server balances between them, so the mean is the fraction of the instance's KV capacity
    # in use. Max would let one momentarily hot rank make the whole instance look full.
    for name in KV_USAGE:
        if values := kv.get(name):
            return min(1.0, max(0.0, sum(values) / len(values)))
    return None


def hit_rate(prev: EngineSample, cur: EngineSample) -> float | None:
    """Prefix-cache hit rate (hit tokens / queried tokens) between two samples of one instance.

    A counter that went down means the instance restarted (counters restart at zero), so the
    current values are themselves the deltas since the restart. ``None`` when the counters are
    missing or nothing was queried in between.
    """
    pq, ph, cq, ch = prev.prefix_queries, prev.prefix_hits, cur.prefix_queries, cur.prefix_hits
    if pq is None or ph is None or cq is None or ch is None:
        return None
    queries, hits = cq - pq, ch - ph
    if queries < 0 or hits < 0:  # reset: the instance restarted between the two scrapes
        queries, hits = cq, ch
    if queries <= 0:
        return None
    return min(1.0, max(0.0, hits / queries))


@dataclass(frozen=True, slots=True)
class EngineWindow:
    """The requests that finished between two scrapes, as the engine measured them (means)."""

    requests: float
    prefill_seconds: float  # mean from first scheduled to first token
    queue_seconds: float  # mean wait to be scheduled (for a batch slot or token budget)
    computed_tokens: float  # mean prompt tokens prefilled, cache hits excluded
    prompt_tokens: float | None  # mean prompt tokens, cache hits included
    decode_seconds_per_token: float | None  # output tokens after the first, over the decode time


def engine_window(prev: EngineSample, cur: EngineSample) -> EngineWindow | None:
    """What the engine measured for the requests that finished between ``prev`` and ``cur``.

    ``None`` when the engine does not report its phases or nothing finished in between. Counters that
    went down mean the instance restarted: the current sums are then the window, as in ``hit_rate``.
    Without ``request_prefill_kv_computed_tokens`` (older vLLM) the whole prompt is taken as
    computed, less the prefix-cache hits counted in the same window."""
    if cur.finished is None or cur.prefill_time is None or prev.finished is None:
        return None
    restarted = cur.finished < prev.finished

    def delta(a: float | None, b: float | None) -> float | None:
        if b is None:
            return None
        if restarted or a is None:
            return b
        return b - a

    n = delta(prev.finished, cur.finished) or 0.0
    prefill = delta(prev.prefill_time, cur.prefill_time)
    if n < 1 or prefill is None or prefill < 0:
        return None
    prompt = delta(prev.request_prompt_tokens, cur.request_prompt_tokens)
    computed = delta(prev.computed_tokens, cur.computed_tokens)
    if computed is None and prompt is not None:
        hits = delta(prev.prefix_hits, cur.prefix_hits) or 0.0
        computed = max(0.0, prompt - hits)
    if computed is None:
        return None
    queue = delta(prev.queue_time, cur.queue_time) or 0.0
    decode = delta(prev.decode_time, cur.decode_time)
    generated = delta(prev.request_generation_tokens, cur.request_generation_tokens)
    pace = None
    if decode is not None and generated is not None and generated - n >= 1 and decode > 0:
        pace = decode / (generated - n)  # each request's first token came with its prefill
    return EngineWindow(
        requests=n,
        prefill_seconds=prefill / n,
        queue_seconds=max(0.0, queue) / n,
        computed_tokens=max(0.0, computed) / n,
        prompt_tokens=None if prompt is None else max(0.0, prompt) / n,
        decode_seconds_per_token=pace,
    )


def stale_after(interval: float) -> float:
    """Seconds after which a sample scraped every ``interval`` seconds is no longer trusted."""
    return max(STALE_INTERVALS * interval, STALE_MIN_SECONDS)


def is_stale(sample_time: float | None, now: float, interval: float) -> bool:
    """True when the sample is missing or older than ``stale_after(interval)`` (monotonic seconds).

    A scrape that stopped answering keeps its last values in memory; past this age dispatch must fall
    back to what it knows for itself (its own in-flight counts) instead of trusting old queue depths.
    """
    return sample_time is None or now - sample_time > stale_after(interval)


def engine_stats(
    cur: EngineSample | None,
    prev: EngineSample | None,
    sample_time: float | None,
    now: float,
    interval: float,
) -> EngineStats | None:
    """What dispatch may use from the latest scrape: ``None`` when missing, partial or stale.

    ``None`` makes the dispatcher decide on our own in-flight counts alone (and say so), rather than
    on queue depths that may be minutes old: a router that silently trusts a view that no longer
    matches the fleet piles work onto an instance that is already busy.
    """
    if cur is None or sample_time is None or is_stale(sample_time, now, interval):
        return None
    running, waiting = cur.running, cur.waiting
    if running is None or waiting is None:
        return None
    return EngineStats(
        waiting=waiting,
        running=running,
        kv_usage=cur.kv_usage,
        prefix_hit_rate=hit_rate(prev, cur) if prev is not None else None,
        age=max(0.0, now - sample_time),
    )
