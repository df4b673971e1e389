"""What to compare, and the machinery to stand each configuration up on loopback.

A ``Scenario`` is one row of the side-by-side comparison (``bench --compare``):

- ``direct``: round robin straight to the instances, each with its own key ("no unified channel");
- ``gateway``: an in-process taogate on 127.0.0.1 in front of the instances, with a given strategy,
  prefix affinity and per-instance cap;
- ``pooled``: the bound no dispatcher can beat, ONE emulated instance with the fleet's pooled capacity
  (prefill and decode speeds summed over the instances, slowdowns applied; batch slots and KV summed).

Each emulated scenario gets a fresh fleet, so caches, learned speeds and stats never leak between rows.
With ``isolated=True`` the fleet and the gateway each run in a process of their own
(``bench.isolated``), so neither the gateway's nor the load generator's CPU slows the emulated engines.
"""

from __future__ import annotations

import contextlib
import math
import secrets
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import httpx

from taogate.app import serve_gateway
from taogate.bench.isolated import fleet_process, fleet_stats, gateway_process
from taogate.bench.procs import rss_bytes
from taogate.bench.report import Summary, instance_labels, summarize
from taogate.bench.runner import Run, Sample, Target, run_load
from taogate.bench.workloads import Workload
from taogate.emulator.config import EmulatorConfig
from taogate.emulator.fleet import run_fleet
from taogate.fleet.engine import ScrapeError, parse_vllm_metrics
from taogate.settings import Settings

__all__ = [
    "COMPARE",
    "POOLED",
    "Outcome",
    "Scenario",
    "counter_hits",
    "fleet_capacity",
    "fleet_configs",
    "gateway_settings",
    "instance_capacity",
    "loopback_settings",
    "pooled_config",
    "prefix_counters",
    "run_scenario",
]

Kind = Literal["direct", "gateway", "pooled"]


@dataclass(frozen=True, slots=True)
class Scenario:
    label: str
    kind: Kind
    strategy: str = "least_busy"
    prefix_affinity: bool = False
    max_queue: int = 32
    prefix_caching: bool | None = None  # emulated only: override the fleet's setting for this row
    dispatch: tuple[tuple[str, Any], ...] = ()  # more [dispatch] settings for this row


COMPARE: tuple[Scenario, ...] = (
    Scenario("direct rr (no unified channel)", "direct", "round_robin"),
    Scenario("gw round_robin", "gateway", "round_robin"),
    Scenario("gw least_busy", "gateway", "least_busy"),
    Scenario("gw least_busy+affinity", "gateway", "least_busy", prefix_affinity=True),
)
POOLED = Scenario("pooled bound", "pooled")


def fleet_configs(
    n: int = 4,
    slow: Mapping[int, float] | None = None,
    *,
    prefix_caching: bool = False,
    base: EmulatorConfig | None = None,
) -> list[EmulatorConfig]:
    """``n`` emulator configs; ``slow`` maps an index to its slowdown factor (2.5 = 2.5x slower)."""
    # Usage reports cached tokens, as the emulator always did before it learned vLLM's default.
    base = base or EmulatorConfig(enable_prompt_tokens_details=True)
    slow = slow or {}
    for i in slow:
        if not 0 <= i < n:
            raise ValueError(f"slow instance index {i} is outside 0..{n - 1}")
    return [
        replace(base, seed=i, enable_prefix_caching=prefix_caching, slowdown=slow.get(i, base.slowdown))
        for i in range(n)
    ]


def pooled_config(configs: Sequence[EmulatorConfig]) -> EmulatorConfig:
    """One instance as fast as the whole fleet: speeds summed (each divided by its slowdown), slots summed."""
    if not configs:
        raise ValueError("pooled_config needs at least one config")
    first = configs[0]
    return replace(
        first,
        prefill_tokens_per_s=sum(c.prefill_tokens_per_s / c.slowdown for c in configs),
        decode_tokens_per_s=sum(c.decode_tokens_per_s / c.slowdown for c in configs),
        max_num_seqs=sum(c.max_num_seqs for c in configs),
        max_num_batched_tokens=sum(c.max_num_batched_tokens for c in configs),
        kv_cache_tokens=sum(c.kv_cache_tokens for c in configs),
        num_gpu_blocks_override=(
            sum(c.num_kv_blocks for c in configs) if any(c.num_gpu_blocks_override for c in configs) else None
        ),
        step_overhead=min(c.step_overhead for c in configs),
        slowdown=1.0,
        seed=0,
    )


def instance_capacity(config: EmulatorConfig) -> float:
    """Prompt tokens/s one instance prefills when every step is a full batch (from its cost model)."""
    batch = config.max_num_batched_tokens
    step = (config.step_overhead + batch / config.prefill_tokens_per_s) * config.slowdown
    return batch / step


def fleet_capacity(configs: Sequence[EmulatorConfig]) -> float:
    return sum(instance_capacity(c) for c in configs)


def loopback_settings(
    urls: Sequence[str],
    *,
    names: Sequence[str] | None = None,
    roles: Sequence[str] | None = None,
    **sections: Mapping[str, Any],
) -> Settings:
    """Settings for a gateway on 127.0.0.1 in front of ``urls``: instances named i0, i1, ... (or
    ``names``, with ``roles``), probes and scrapes every fraction of a second; ``sections`` (nested
    as in config.toml) override."""
    instances: list[dict[str, Any]] = []
    for n, url in enumerate(urls):
        item: dict[str, Any] = {"url": url, "name": names[n] if names else f"i{n}"}
        if roles is not None:
            item["role"] = roles[n]
        instances.append(item)
    data: dict[str, Any] = {
        "gateway": {"base_url": "http://127.0.0.1:8080/api", "host": "127.0.0.1"},
        "dispatch": {"health_check_interval": 0.5, "scrape_interval": 0.2},
        "instances": instances,
    }
    for name, values in sections.items():
        data.setdefault(name, {}).update(values)
    return Settings(**data)


def gateway_settings(
    urls: Sequence[str], scenario: Scenario, *, names: Sequence[str] | None = None, **dispatch: Any
) -> Settings:
    """The gateway of a benchmark ``scenario`` in front of ``urls``: its strategy and cap, and a
    queue that is never the bottleneck under test."""
    return loopback_settings(
        urls,
        names=names,
        gateway={"request_timeout": 300},
        dispatch={
            "strategy": scenario.strategy,
            "prefix_affinity": scenario.prefix_affinity,
            "max_queue_per_instance": scenario.max_queue,
            "queue_size": 4096,
            "queue_timeout": 300,
            **dispatch,
        },
    )


async def prefix_counters(urls: Sequence[str]) -> list[tuple[float, float] | None]:
    """Each instance's prefix-cache (queries, hits) counters from its /metrics (None: unreadable)."""
    out: list[tuple[float, float] | None] = []
    async with httpx.AsyncClient(timeout=30, trust_env=False) as client:
        for url in urls:
            try:
                sample = parse_vllm_metrics((await client.get(url + "/metrics")).text)
            except (httpx.HTTPError, ScrapeError):
                out.append(None)
                continue
            q, h = sample.prefix_queries, sample.prefix_hits
            out.append(None if q is None or h is None else (q, h))
    return out


def counter_hits(
    before: Sequence[tuple[float, float] | None], after: Sequence[tuple[float, float] | None]
) -> list[float]:
    """Per instance, the share of queried prompt tokens its prefix cache served in between (NaN when
    unknown or nothing was queried)."""
    out = []
    for b, a in zip(before, after, strict=True):
        if a is None or b is None or a[0] <= b[0]:
            out.append(math.nan)
        else:
            out.append(max(0.0, a[1] - b[1]) / (a[0] - b[0]))
    return out


async def admin_instances(url: str, key: str) -> dict[str, Any] | None:
    """The gateway's ``GET /admin/instances`` (None when it cannot be read)."""
    try:
        async with httpx.AsyncClient(timeout=10, trust_env=False) as client:
            r = await client.get(url + "/admin/instances", headers={"authorization": f"Bearer {key}"})
    except httpx.HTTPError:
        return None
    if r.status_code != 200:
        return None
    data: dict[str, Any] = r.json()
    return data


@dataclass(slots=True)
class Outcome:
    """One scenario run: samples, summary, and what the servers said."""

    scenario: Scenario
    run: Run
    summary: Summary
    admin: dict[str, Any] | None = None  # the gateway's /admin/instances after the run
    emulator: list[dict[str, Any]] = field(default_factory=list)  # per-instance emulator stats
    engine_hits: tuple[float, float] | None = None  # real fleet: prefix-cache (queries, hits) in the run
    gateway_rss: int = 0  # bytes, after the run (isolated gateways only)

    @property
    def cache_hit_rate(self) -> float:
        """From the emulators' own books (cached over prompt tokens), or the real instances' own
        prefix-cache counters; falls back to usage (vLLM reports none without
        --enable-prompt-tokens-details)."""
        prompt = sum(int(s.get("prompt_tokens", 0)) for s in self.emulator)
        if prompt:
            return sum(int(s.get("cached_tokens", 0)) for s in self.emulator) / prompt
        if self.engine_hits is not None and self.engine_hits[0] > 0:
            return self.engine_hits[1] / self.engine_hits[0]
        return self.summary.cache_hit_rate


SampleHook = Callable[[Sample], None]


async def _gateway_run(
    urls: Sequence[str],
    scenario: Scenario,
    *,
    workload: Workload,
    model: str,
    names: Sequence[str],
    load: dict[str, Any],
    isolated: bool = False,
    rss: list[int] | None = None,
) -> tuple[Run, dict[str, Any] | None]:
    settings = gateway_settings(urls, scenario, names=names, **dict(scenario.dispatch))
    key = secrets.token_urlsafe(24)
    pids: list[int] = []
    async with contextlib.AsyncExitStack() as stack:
        if isolated:
            url = await stack.enter_async_context(gateway_process(settings, key, pids.append))
        else:
            url = (await stack.enter_async_context(serve_gateway(settings, key=key))).url
        run = await run_load([Target(url + "/v1", key)], workload, model, label=scenario.label, **load)
        if rss is not None and pids:
            rss.append(rss_bytes(pids[0]))
        return run, await admin_instances(url, key)


async def run_scenario(
    scenario: Scenario,
    workload: Workload,
    *,
    configs: Sequence[EmulatorConfig] | None = None,
    urls: Sequence[str] | None = None,
    instance_key: str = "",
    model: str = "emulated-model",
    headers: Mapping[str, str] | None = None,
    max_requests: int | None = None,
    max_seconds: float = 300.0,
    on_sample: SampleHook | None = None,
    isolated: bool = False,
    names: Sequence[str] | None = None,
) -> Outcome:
    """Run ``workload`` under ``scenario``: on a fresh emulated fleet (``configs``) or real ``urls``
    (named ``names``, else host:port as everywhere); ``isolated``: the emulated fleet and the
    gateway in processes of their own."""
    load: dict[str, Any] = {
        "headers": headers,
        "max_requests": max_requests,
        "max_seconds": max_seconds,
        "on_sample": on_sample,
    }
    if configs is None:
        if urls is None or scenario.kind == "pooled":
            raise ValueError(f"scenario {scenario.label!r} needs emulator configs")
        names = list(names or instance_labels(urls))
        before = await prefix_counters(urls)
        admin = None
        if scenario.kind == "direct":
            targets = [Target(u + "/v1", instance_key, names[n]) for n, u in enumerate(urls)]
            run = await run_load(targets, workload, model, label=scenario.label, **load)
        else:
            run, admin = await _gateway_run(
                urls, scenario, workload=workload, model=model, names=names, load=load
            )
        after = await prefix_counters(urls)
        known = [(b, a) for b, a in zip(before, after, strict=True) if a is not None and b is not None]
        hits = (sum(a[0] - b[0] for b, a in known), sum(a[1] - b[1] for b, a in known)) if known else None
        return Outcome(scenario, run, summarize(scenario.label, run.samples, names), admin, engine_hits=hits)

    if scenario.prefix_caching is not None:
        configs = [replace(c, enable_prefix_caching=scenario.prefix_caching) for c in configs]
    fleet_cfgs = [pooled_config(configs)] if scenario.kind == "pooled" else list(configs)
    names = ["pooled"] if scenario.kind == "pooled" else [f"i{n}" for n in range(len(fleet_cfgs))]
    model = fleet_cfgs[0].model
    admin = None
    async with contextlib.AsyncExitStack() as stack:
        if isolated:
            fleet_urls = await stack.enter_async_context(fleet_process(fleet_cfgs))
        else:
            fleet = await stack.enter_async_context(run_fleet(fleet_cfgs))
            fleet_urls = fleet.urls
        rss: list[int] = []
        if scenario.kind == "gateway":
            run, admin = await _gateway_run(
                fleet_urls,
                scenario,
                workload=workload,
                model=model,
                names=names,
                load=load,
                isolated=isolated,
                rss=rss,
            )
        else:
            targets = [Target(u + "/v1", "", names[n]) for n, u in enumerate(fleet_urls)]
            run = await run_load(targets, workload, model, label=scenario.label, **load)
        stats = await fleet_stats(fleet_urls) if isolated else [inst.stats() for inst in fleet.instances]
    summary = summarize(scenario.label, run.samples, names)
    return Outcome(scenario, run, summary, admin, stats, gateway_rss=rss[0] if rss else 0)
