"""The /metrics parser on text shaped like real vLLM output (V1 engine names and the older V0 ones)."""

from __future__ import annotations

import pytest

from taogate.fleet.engine import (
    EngineSample,
    ScrapeError,
    engine_stats,
    engine_window,
    hit_rate,
    is_stale,
    parse_vllm_metrics,
    stale_after,
)

MODEL = "Qwen/Qwen2.5-7B-Instruct"

# Shaped like vLLM v0.10 (V1 engine) /metrics: HELP/TYPE lines, engine + model_name labels, counters
# with _total and the _created samples prometheus_client adds, histograms we must ignore, and the
# process/python collectors' metrics around them.
V1_METRICS = f"""\
# HELP python_gc_objects_collected_total Objects collected during gc
# TYPE python_gc_objects_collected_total counter
python_gc_objects_collected_total{{generation="0"}} 12345.0
# HELP process_resident_memory_bytes Resident memory size in bytes.
# TYPE process_resident_memory_bytes gauge
process_resident_memory_bytes 2.1474836e+09
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{engine="0",model_name="{MODEL}"}} 7.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{{engine="0",model_name="{MODEL}"}} 3.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{{engine="0",model_name="{MODEL}"}} 0.4125
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{{engine="0",model_name="{MODEL}"}} 40960.0
# HELP vllm:prefix_cache_queries_created Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_created gauge
vllm:prefix_cache_queries_created{{engine="0",model_name="{MODEL}"}} 1.7291e+09
# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{{engine="0",model_name="{MODEL}"}} 30720.0
# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{{engine="0",model_name="{MODEL}"}} 0.0
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{{engine="0",model_name="{MODEL}"}} 262144.0
vllm:prompt_tokens_created{{engine="0",model_name="{MODEL}"}} 1.7291e+09
# HELP vllm:generation_tokens_total Number of generation tokens processed.
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{{engine="0",model_name="{MODEL}"}} 1024.0
# HELP vllm:request_success_total Count of successfully processed requests.
# TYPE vllm:request_success_total counter
vllm:request_success_total{{engine="0",finished_reason="stop",model_name="{MODEL}"}} 50.0
vllm:request_success_total{{engine="0",finished_reason="length",model_name="{MODEL}"}} 14.0
vllm:request_success_total{{engine="0",finished_reason="abort",model_name="{MODEL}"}} 0.0
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_sum{{engine="0",model_name="{MODEL}"}} 91.5
vllm:time_to_first_token_seconds_bucket{{engine="0",le="0.001",model_name="{MODEL}"}} 0.0
vllm:time_to_first_token_seconds_bucket{{engine="0",le="0.5",model_name="{MODEL}"}} 10.0
vllm:time_to_first_token_seconds_bucket{{engine="0",le="+Inf",model_name="{MODEL}"}} 64.0
vllm:time_to_first_token_seconds_count{{engine="0",model_name="{MODEL}"}} 64.0
# HELP vllm:cache_config_info Information of the LLMCache
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{{block_size="16",cache_dtype="auto",enable_prefix_caching="True",engine="0"}} 1.0
"""

# vLLM V0 (and early V1) names: gpu_cache_usage_perc and gpu_prefix_cache_*; no engine label.
V0_METRICS = """\
# HELP vllm:num_requests_running Number of requests currently running on GPU.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="llama"} 2.0
# HELP vllm:num_requests_swapped Number of requests swapped to CPU.
# TYPE vllm:num_requests_swapped gauge
vllm:num_requests_swapped{model_name="llama"} 0.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="llama"} 5.0
# HELP vllm:gpu_cache_usage_perc GPU KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{model_name="llama"} 0.9
# HELP vllm:gpu_prefix_cache_queries_total GPU prefix cache queries.
# TYPE vllm:gpu_prefix_cache_queries_total counter
vllm:gpu_prefix_cache_queries_total{model_name="llama"} 100.0
# HELP vllm:gpu_prefix_cache_hits_total GPU prefix cache hits.
# TYPE vllm:gpu_prefix_cache_hits_total counter
vllm:gpu_prefix_cache_hits_total{model_name="llama"} 25.0
"""


def _two_engines(kv0: float, kv1: float) -> str:
    lines = ["# TYPE vllm:num_requests_running gauge", "# TYPE vllm:kv_cache_usage_perc gauge"]
    for engine, kv in (("0", kv0), ("1", kv1)):
        lines += [
            f'vllm:num_requests_running{{engine="{engine}",model_name="m"}} 4.0',
            f'vllm:num_requests_waiting{{engine="{engine}",model_name="m"}} 1.0',
            f'vllm:kv_cache_usage_perc{{engine="{engine}",model_name="m"}} {kv}',
        ]
    return "\n".join(lines) + "\n"


def test_v1_metrics_are_read_and_histograms_ignored() -> None:
    s = parse_vllm_metrics(V1_METRICS)
    assert s == EngineSample(
        running=7.0,
        waiting=3.0,
        kv_usage=0.4125,
        prefix_queries=40960.0,
        prefix_hits=30720.0,
        prompt_tokens=262144.0,
        generation_tokens=1024.0,
        request_success=64.0,  # summed over finished_reason
        engines=1,
    )
    assert s.has_load


def test_old_gpu_names_are_the_fallback() -> None:
    s = parse_vllm_metrics(V0_METRICS)
    assert (s.running, s.waiting, s.kv_usage) == (2.0, 5.0, 0.9)
    assert (s.prefix_queries, s.prefix_hits) == (100.0, 25.0)
    assert s.prompt_tokens is None and s.request_success is None


def test_new_kv_name_wins_over_old_when_both_present() -> None:
    text = (
        "# TYPE vllm:gpu_cache_usage_perc gauge\nvllm:gpu_cache_usage_perc 0.9\n"
        "# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc 0.2\n"
    )
    assert parse_vllm_metrics(text).kv_usage == 0.2


def test_engines_are_summed_and_kv_averaged() -> None:
    s = parse_vllm_metrics(_two_engines(0.2, 0.6))
    assert (s.running, s.waiting, s.engines) == (8.0, 2.0, 2)
    assert s.kv_usage == pytest.approx(0.4)


def test_model_filter_keeps_matching_and_unlabelled_samples() -> None:
    text = (
        '# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{model_name="a"} 1\n'
        'vllm:num_requests_running{model_name="b"} 10\nvllm:num_requests_running 100\n'
    )
    assert parse_vllm_metrics(text).running == 111
    assert parse_vllm_metrics(text, model="a").running == 101
    assert parse_vllm_metrics(V1_METRICS, model="other").running is None


@pytest.mark.parametrize("text", ["", "# only a comment\n", "some_other_metric 1\n"])
def test_missing_metrics_are_none_not_errors(text: str) -> None:
    s = parse_vllm_metrics(text)
    assert s == EngineSample()
    assert not s.has_load


def test_nan_is_treated_as_missing() -> None:
    text = "# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc NaN\n"
    assert parse_vllm_metrics(text).kv_usage is None


@pytest.mark.parametrize(
    "text", ["<html><body><h1>404 Not Found</h1></body></html>", '{"detail":"Not Found"}', "Not Found"]
)
def test_garbage_raises_scrape_error(text: str) -> None:
    with pytest.raises(ScrapeError, match="not Prometheus text"):
        parse_vllm_metrics(text)


def test_hit_rate_from_counter_deltas() -> None:
    prev = EngineSample(prefix_queries=1000.0, prefix_hits=500.0)
    cur = EngineSample(prefix_queries=2000.0, prefix_hits=1400.0)
    assert hit_rate(prev, cur) == pytest.approx(0.9)


def test_hit_rate_after_restart_uses_values_since_restart() -> None:
    prev = EngineSample(prefix_queries=10_000.0, prefix_hits=9_000.0)
    cur = EngineSample(prefix_queries=100.0, prefix_hits=25.0)  # counters restarted at zero
    assert hit_rate(prev, cur) == pytest.approx(0.25)


def test_hit_rate_unknown_without_counters_or_queries() -> None:
    same = EngineSample(prefix_queries=5.0, prefix_hits=1.0)
    assert hit_rate(same, same) is None
    assert hit_rate(EngineSample(), same) is None


def test_staleness() -> None:
    assert stale_after(1.0) == 3.0
    assert stale_after(0.1) == 2.0  # floor: a short interval must not make every sample stale
    assert not is_stale(10.0, 12.9, 1.0)
    assert is_stale(10.0, 13.1, 1.0)
    assert is_stale(None, 0.0, 1.0)


def test_engine_stats_for_dispatch() -> None:
    prev = parse_vllm_metrics(V0_METRICS)
    cur = EngineSample(running=2.0, waiting=5.0, kv_usage=0.9, prefix_queries=200.0, prefix_hits=75.0)
    stats = engine_stats(cur, prev, sample_time=100.0, now=101.0, interval=1.0)
    assert stats is not None
    assert (stats.running, stats.waiting, stats.kv_usage, stats.age) == (2.0, 5.0, 0.9, 1.0)
    assert stats.prefix_hit_rate == pytest.approx(0.5)
    assert engine_stats(cur, None, 100.0, 110.0, 1.0) is None  # stale
    assert engine_stats(EngineSample(running=1.0), None, 100.0, 100.0, 1.0) is None  # partial
    assert engine_stats(None, None, None, 100.0, 1.0) is None


def _phases(finished: float, *values: float) -> str:
    """vLLM's per-request phase histograms (prefill, queue, decode seconds; computed, prompt,
    generated tokens): the +Inf bucket, _count and _sum samples."""
    lab = f'{{engine="0",model_name="{MODEL}"}}'
    names: tuple[str, ...] = ("request_prefill_time_seconds", "request_queue_time_seconds")
    names += ("request_decode_time_seconds",)
    names += ("request_prefill_kv_computed_tokens", "request_prompt_tokens", "request_generation_tokens")
    lines = []
    count = finished
    for short, total in zip(names, values, strict=True):
        name = f"vllm:{short}"
        lines += [
            f"# TYPE {name} histogram",
            f'{name}_bucket{{engine="0",le="+Inf",model_name="{MODEL}"}} {count}',
        ]
        lines += [f"{name}_count{lab} {count}", f"{name}_sum{lab} {total}"]
    return "\n".join(lines) + "\n"


def test_engine_window_is_what_the_engine_measured_in_between() -> None:
    before = parse_vllm_metrics(_phases(10, 2.0, 0.5, 3.0, 8000, 10000, 170))
    after = parse_vllm_metrics(_phases(14, 3.0, 2.5, 4.2, 12000, 16000, 234))
    window = engine_window(before, after)
    assert window is not None
    assert window.requests == 4
    assert window.prefill_seconds == pytest.approx(0.25)  # without the 0.5 s each waited for a slot
    assert window.queue_seconds == pytest.approx(0.5)
    assert (window.computed_tokens, window.prompt_tokens) == (1000, 1500)
    assert window.decode_seconds_per_token == pytest.approx(1.2 / (64 - 4))
    assert engine_window(after, after) is None  # nothing finished in between
    assert engine_window(EngineSample(), after) is None  # an engine that reports no phases
    restarted = engine_window(after, parse_vllm_metrics(_phases(2, 0.2, 0.0, 0.1, 500, 500, 10)))
    assert restarted is not None and restarted.requests == 2 and restarted.computed_tokens == 250


def test_data_parallel_cache_is_the_total_once_and_one_rank_holds_its_share() -> None:
    # vLLM writes the engines' summed num_gpu_blocks on every engine's row
    rows = "".join(
        f'vllm:cache_config_info{{block_size="16",enable_prefix_caching="True",engine="{e}",'
        f'num_gpu_blocks="201",prefix_caching_hash_algo="sha256"}} 1.0\n'
        for e in ("0", "1")
    )
    config = parse_vllm_metrics("# TYPE vllm:cache_config_info gauge\n" + rows).cache_config
    assert config is not None
    assert config.num_gpu_blocks == 201 and config.engines == 2
    assert config.usable_blocks_per_engine == 99
