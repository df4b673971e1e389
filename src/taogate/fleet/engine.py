"""Pure parser of a vLLM instance's Prometheus ``/metrics`` text into one ``EngineSample``.

The scrape loop (``control.scraper``) fetches the text and stamps the time; everything here is
plain data in, plain data out, so it is tested on fixture text without a server::

    /metrics text ──parse_vllm_metrics──► EngineSample ──┬── running, waiting, kv_usage (gauges)
                                                         └── counters ──hit_rate(prev, cur)──► 0..1

    sample age:  fresh ──(> max(3 × interval, 2 s))──► stale: not trusted by dispatch

Why these metrics: the engine's own ``waiting``/``running`` gauges count work from every gateway
replica, which our in-flight counts cannot see. The KV-cache gauge was renamed in vLLM's V1 engine
(``vllm:gpu_cache_usage_perc`` → ``vllm:kv_cache_usage_perc``) and so were the prefix-cache counters
(``vllm:gpu_prefix_cache_*`` → ``vllm:prefix_cache_*``); the new name wins and the old one is the
fallback, so one gateway serves a mixed-version fleet.

Errors: ``ScrapeError`` (a ``ValueError``) for text that is not Prometheus exposition at all (an HTML
error page, JSON). A well-formed text that lacks a metric gives ``None`` for that field, never an
exception: an instance that is still loading, or an older vLLM, must not break the scrape loop.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from taogate.dispatch.types import EngineStats

__all__ = [
    "CacheConfig",
    "EngineSample",
    "ScrapeError",
    "engine_stats",
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
CACHE_CONFIG = "vllm:cache_config_info"

_WANTED = frozenset(
    {
        RUNNING,
        WAITING,
        PROMPT_TOKENS,
        GENERATION_TOKENS,
        REQUEST_SUCCESS,
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
    """The KV cache's shape, from ``vllm:cache_config_info``'s labels (summed over its engines)."""

    num_gpu_blocks: int  # the null block included: one fewer is usable
    block_size: int
    prefix_caching: bool
    hash_algo: str | None = None

    @property
    def usable_blocks(self) -> int:
        return max(0, self.num_gpu_blocks - 1)


def _cache_config(labels: dict[str, str]) -> CacheConfig | None:
    try:
        blocks, size = int(labels["num_gpu_blocks"]), int(labels["block_size"])
    except (KeyError, ValueError):
        return None  # "None" before the engine has sized its cache
    if blocks <= 0 or size <= 0:
        return None
    caching = labels.get("enable_prefix_caching", "True").lower() == "true"
    return CacheConfig(blocks, size, caching, labels.get("prefix_caching_hash_algo"))


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
    kept = "\n".join(line for line in text.splitlines() if line.startswith(_WANTED_PREFIXES))
    if not kept and not _looks_like_exposition(text):
        snippet = text[:80].replace("\n", "\\n")
        raise ScrapeError(f"not Prometheus text exposition: {snippet!r}")
    try:
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
                if name == CACHE_CONFIG:  # an info gauge: the labels are the data (no model_name)
                    found = _cache_config(labels)
                    if found is not None:
                        configs[labels.get("engine", "")] = found
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
        engines=len(engines),
        cache_config=_merge_configs(list(configs.values())),
    )


def _merge_configs(configs: list[CacheConfig]) -> CacheConfig | None:
    """One instance's cache over its data-parallel engines: their blocks summed."""
    if not configs:
        return None
    first = configs[0]
    blocks = sum(c.num_gpu_blocks for c in configs)
    return CacheConfig(blocks, first.block_size, first.prefix_caching, first.hash_algo)


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
