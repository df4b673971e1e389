"""Is it dispatch, one slow instance, or nothing? The queue-cap bisection, automated.

``diagnose`` probes each instance alone (prefill speed from a ~4,096-token prompt's TTFT, several
tries), then runs the same load through a loopback gateway twice: with the configured
``max_queue_per_instance`` (run A) and with it lowered to ``low_cap`` (run B). Every request has a
prefix of its own, so prefix-cache hits cannot pass for an imbalance.

``decide`` (pure), first match wins: **error** (exit 3) when a run had no successful request;
**dispatch** (exit 1) when the lower cap fixed the latency (unless a slow card kept under its fair
share explains it: then **slow**); **slow** (exit 2) when it did not and an instance probes well
below the median (or, unprobed, reads so to the gateway's learning); **balanced** (exit 0) when run
A's max/mean is within ``IMBALANCE_RATIO``; **inside** (exit 2) when it is still imbalanced with no
slow instance: look inside vLLM and at what shares the instances' CPUs. The exact thresholds and their guards:
benchmarks/README.md, "Design notes moved from the code".
"""

from __future__ import annotations

import math
import secrets
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx

from taogate.app import serve_gateway
from taogate.bench.report import IMBALANCE_RATIO, Summary, instance_labels, ratio, summarize
from taogate.bench.runner import Run, Sample, Target, run_load
from taogate.bench.scenarios import Scenario, admin_instances, counter_hits, gateway_settings, prefix_counters
from taogate.bench.workloads import RequestSpec, Workload, filler, salted, unshared

__all__ = [
    "DROP",
    "EXIT_CODES",
    "SLOW",
    "Diagnosis",
    "Evidence",
    "Verdict",
    "decide",
    "diagnose",
    "own_speeds",
    "peak_per_instance",
    "probe_speeds",
    "too_long",
]

DROP = 1.5
SLOW = 0.6
VerdictKind = Literal["balanced", "dispatch", "slow", "inside", "error"]
EXIT_CODES: dict[VerdictKind, int] = {"balanced": 0, "dispatch": 1, "slow": 2, "inside": 2, "error": 3}


@dataclass(frozen=True, slots=True)
class Evidence:
    """What the decision is made from (plain data, so the rule is tested without any server)."""

    configured: Summary  # run A, the configured cap
    lowered: Summary  # run B, the lowered cap
    cap: int
    low_cap: int
    probe_speeds: Mapping[str, float] = field(default_factory=dict)  # own prefill tokens/s: best try
    relative_speed: Mapping[str, float] = field(default_factory=dict)  # the gateway's learned view
    cache_hit_rate: float = math.nan
    peak_per_instance: int | None = None  # most requests in flight on one instance in run A
    probe_range: Mapping[str, tuple[float, float]] = field(default_factory=dict)  # slowest, fastest try
    instance_hits: Mapping[str, float] = field(default_factory=dict)  # from each one's own counters


@dataclass(frozen=True, slots=True)
class Verdict:
    kind: VerdictKind
    headline: str
    evidence: tuple[str, ...]
    instance: str | None = None

    @property
    def exit_code(self) -> int:
        return EXIT_CODES[self.kind]


def own_speeds(tries: Mapping[str, Sequence[float]]) -> dict[str, float]:
    """Each instance's own speed from its probes' tries: its best (0.0 without one). A busy machine
    only slows a try, and no probe can hit the prefix cache, so the best is the least disturbed."""
    return {name: max(speeds) if speeds else 0.0 for name, speeds in tries.items()}


def _slowest(speeds: Mapping[str, float], slow: float) -> tuple[str, float] | None:
    """The slowest instance and its speed relative to the median, if it is below ``slow``."""
    known = {k: v for k, v in speeds.items() if v > 0 and not math.isnan(v)}
    if len(known) < 2:
        return None
    median = statistics.median(known.values())
    name = min(known, key=lambda k: known[k])
    rel = known[name] / median
    return (name, rel) if rel < slow else None


def _run_line(tag: str, s: Summary) -> str:
    late = max(
        s.per_instance.items(), key=lambda kv: kv[1].last_finish if kv[1].count else -1.0, default=None
    )
    last = f"; last to finish: {late[0]} at {late[1].last_finish:.2f}s" if late and late[1].count else ""
    counts = ", ".join(f"{k} {v.count}" for k, v in s.per_instance.items())
    return (
        f"{tag}: mean {s.latency.mean:.2f}s, max {s.latency.max:.2f}s, max/mean {s.max_over_mean:.2f}"
        f"; requests per instance: {counts}{last}"
    )


def decide(ev: Evidence, *, drop: float = DROP, slow: float = SLOW) -> Verdict:
    """Apply the documented rule to the evidence."""
    a, b = ev.configured, ev.lowered
    if a.ok == 0 or b.ok == 0:
        return Verdict(
            "error",
            "could not run: a run had no successful request",
            (f"errors A: {a.errors or '-'}", f"errors B: {b.errors or '-'}"),
        )
    gain = ratio(a.latency.max, b.latency.max)
    lines = [
        _run_line(f"cap {ev.cap}", a),
        _run_line(f"cap {ev.low_cap}", b),
        f"max latency cap {ev.cap} / cap {ev.low_cap} = {gain:.2f} (dispatch when >= {drop:g})",
    ]
    if ev.probe_speeds:
        spread = ev.probe_range
        lines.append(
            "own prefill speed, probed alone (tokens/s, its best try [slowest-best]): "
            + ", ".join(
                f"{k} {v:,.0f}" + (f" [{spread[k][0]:,.0f}-{spread[k][1]:,.0f}]" if k in spread else "")
                for k, v in ev.probe_speeds.items()
            )
        )
    if ev.instance_hits:
        lines.append(
            "prefix-cache hit rate per instance, from its own counters: "
            + ", ".join(
                f"{k} {'-' if math.isnan(v) else format(v, '.0%')}" for k, v in ev.instance_hits.items()
            )
        )
    if ev.relative_speed:
        lines.append(
            "gateway's learned relative speed: "
            + ", ".join(f"{k} {v:.2f}" for k, v in ev.relative_speed.items())
        )
    probed = {k: v for k, v in ev.probe_speeds.items() if v > 0}
    unprobed = [k for k in ev.probe_speeds if k not in probed]
    if unprobed:
        # An instance left out of the probes' comparison would pass for as fast as the rest.
        lines.append(
            f"no probe of {', '.join(unprobed)} came back with a first token: the slow-instance "
            "check uses the gateway's learned speeds"
        )
    slowest = _slowest(probed if probed and not unprobed else ev.relative_speed, slow)
    dispatch_fixed_it = gain >= drop
    if dispatch_fixed_it and ev.peak_per_instance is not None and ev.peak_per_instance <= ev.low_cap:
        lines.append(
            f"the cap of {ev.low_cap} never bound: run A had at most {ev.peak_per_instance} requests on "
            f"one instance, so both runs dispatched alike and the {gain:.1f}x is noise"
        )
        dispatch_fixed_it = False
    if slowest is not None and dispatch_fixed_it:
        # Both signs at once. If dispatch already routes around the slow card (it got well under its
        # fair share in run A), what remains is the card itself; if it got its full share, the queue
        # piled on it is the problem to fix first.
        served = a.per_instance.get(slowest[0])
        share = served.share if served is not None else 0.0  # absent: it served nothing at all
        fair = 1 / max(1, len(ev.probe_speeds or ev.relative_speed))
        if share < 0.75 * fair:
            lines.append(
                f"lowering the cap also helped ({gain:.1f}x), but dispatch already gives "
                f"{slowest[0]} only {share:.0%} of the requests (fair share {fair:.0%})"
            )
            dispatch_fixed_it = False
    if dispatch_fixed_it:
        if slowest is not None:
            lines.append(
                f"also: {slowest[0]} prefills at {slowest[1]:.2f}x the median speed; least_busy routes "
                "around it, round robin piles work on it"
            )
        return Verdict(
            "dispatch",
            f"dispatch: lowering max_queue_per_instance to {ev.low_cap} cut max latency {gain:.1f}x; "
            "a deep queue on one instance was the problem (use least_busy, keep the cap low)",
            tuple(lines),
        )
    if slowest is not None:
        name, rel = slowest
        return Verdict(
            "slow",
            f"instance {name} is slow: its own prefill speed is {rel:.2f}x the median, whatever the "
            "dispatch; look inside it (AllReduce, host-device copies, clocks, other tenants)",
            tuple(lines),
            instance=name,
        )
    imbalance = a.max_over_mean
    if ev.peak_per_instance is not None and ev.peak_per_instance <= ev.low_cap:
        # The cap never bound, so runs A and B are two tries of one configuration: an imbalance from
        # inside vLLM shows in both, while one request held up by a busy spell of the machine lifts
        # one run's max alone (with short requests, a single stall is several times their mean).
        imbalance = min(a.max_over_mean, b.max_over_mean)
        if imbalance < a.max_over_mean:
            lines.append(
                f"max/mean {a.max_over_mean:.2f} at cap {ev.cap} but {b.max_over_mean:.2f} at cap "
                f"{ev.low_cap}, which never bound: the same load twice, judged by the better try"
            )
    if imbalance <= IMBALANCE_RATIO:
        return Verdict(
            "balanced",
            f"balanced: max/mean {imbalance:.2f} is within the max/mean <= {IMBALANCE_RATIO:g} rule "
            "and lowering the cap changed little",
            tuple(lines),
        )
    if ev.cache_hit_rate > 0.3:
        lines.append(
            f"prefix-cache hit rate {ev.cache_hit_rate:.0%}: hits are fast and misses slow, which alone "
            "can exceed 2x; compare with prefix caching off"
        )
    return Verdict(
        "inside",
        f"imbalance remains (max/mean {imbalance:.2f}) but not from dispatch or one slow "
        "instance: look inside vLLM (AllReduce, data movement) and at what else runs on its CPUs",
        tuple(lines),
    )


def peak_per_instance(samples: Sequence[Sample]) -> int:
    """The most requests in flight at once on any one instance (from each request's start and end)."""
    events: dict[str, list[tuple[float, int]]] = {}
    for smp in samples:
        if smp.instance is not None:
            events.setdefault(smp.instance, []).extend(((smp.start, 1), (smp.end, -1)))
    peak = 0
    for marks in events.values():
        now = 0
        for _, step in sorted(marks):  # at equal times an end (-1) sorts before a start
            now += step
            peak = max(peak, now)
    return peak


async def _context_length(url: str, model: str, key: str) -> int | None:
    """The model's ``max_model_len`` from the instance's /v1/models (vLLM and the emulator give it)."""
    headers = {"authorization": f"Bearer {key}"} if key else {}
    try:
        async with httpx.AsyncClient(timeout=10, trust_env=False) as client:
            cards = (await client.get(url + "/v1/models", headers=headers)).json()["data"]
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return None
    for card in cards if isinstance(cards, list) else ():
        if isinstance(card, dict) and card.get("id") == model and isinstance(card.get("max_model_len"), int):
            return int(card["max_model_len"])
    return None


def too_long(error: str | None) -> bool:
    """A 400 that refuses the prompt's length (vLLM's wording, and the emulator's), not another
    refusal a shorter prompt would meet as well."""
    text = (error or "").lower()
    return "context length" in text or "max_model_len" in text or "too long" in text


async def probe_speeds(
    urls: Sequence[str],
    names: Sequence[str],
    *,
    model: str,
    key: str = "",
    prompt_tokens: int = 4096,
    tries: int = 5,
) -> dict[str, list[float]]:
    """Each instance alone, ``tries`` times, in turn with the others (so a busy spell of the machine
    falls on all of them): prompt tokens / TTFT of each try that succeeded."""
    # The smallest context of the fleet: one prompt size for all, so the probes compare alike. Half
    # of it, as the filler runs long on real tokenizers.
    contexts = [c for c in [await _context_length(url, model, key) for url in urls] if c]
    tokens = min(prompt_tokens, min(contexts) // 2) if contexts else prompt_tokens
    out: dict[str, list[float]] = {name: [] for name in names}
    salt = secrets.token_hex(4)
    pairs = list(zip(urls, names, strict=True))
    for t in range(tries):
        for url, name in pairs[t % len(pairs) :] + pairs[: t % len(pairs)]:
            for _ in range(3):  # a prompt past the context is refused: halve it, a few times at most
                text = f"Probe {name} {t} {salt}. {filler(tokens)}"
                spec = RequestSpec(t, text, 1, approx_tokens=tokens)
                run = await run_load(
                    [Target(url + "/v1", key, name)], Workload("probe", (spec,), 1), model, max_seconds=60
                )
                s = run.samples[0]
                if s.status == 400 and tokens > 256 and too_long(s.error):
                    tokens //= 2
                    continue
                if s.ok and s.ttft:
                    out[name].append((s.prompt_tokens or tokens) / s.ttft)
                break
    return out


@dataclass(slots=True)
class Diagnosis:
    verdict: Verdict
    evidence: Evidence
    runs: list[Run]
    admin: list[dict[str, Any] | None]


def _mean(values: Sequence[float]) -> float:
    known = [v for v in values if not math.isnan(v)]
    return sum(known) / len(known) if known else math.nan


async def diagnose(
    urls: Sequence[str],
    workload: Workload,
    *,
    model: str,
    strategy: str = "least_busy",
    cap: int = 32,
    low_cap: int = 8,
    key: str = "",
    probe: bool = True,
    probe_tokens: int = 4096,
    max_seconds: float = 120.0,
    drop: float = DROP,
    slow: float = SLOW,
    on_sample: Any = None,
    shared_prefixes: bool = False,
    names: Sequence[str] | None = None,
) -> Diagnosis:
    """Probe, run with ``cap`` and with ``low_cap`` through loopback gateways, and decide;
    ``shared_prefixes`` keeps the prompts' own prefixes (prefix-cache hits then weigh in). The
    instances are called ``names``, else host:port, as the gateway in front of them calls them."""
    names = list(names or instance_labels(urls))
    tries = await probe_speeds(urls, names, model=model, key=key, prompt_tokens=probe_tokens) if probe else {}
    speeds = own_speeds(tries)
    ranges = {n: (min(v), max(v)) for n, v in tries.items() if v}
    runs: list[Run] = []
    admin: list[dict[str, Any] | None] = []
    summaries: list[Summary] = []
    hits: dict[str, list[float]] = {n: [] for n in names}
    salt = secrets.token_hex(4)
    for tag, limit in (("A", cap), ("B", low_cap)):
        scenario = Scenario(f"{strategy}, cap {limit}", "gateway", strategy, max_queue=limit)
        prefix = f"Diagnose run {tag} {salt}."
        load = salted(workload, prefix) if shared_prefixes else unshared(workload, prefix)
        before = await prefix_counters(urls)
        async with serve_gateway(gateway_settings(urls, scenario, names=names)) as gw:
            run = await run_load(
                [Target(gw.api_base, gw.key)],
                load,
                model,
                label=scenario.label,
                max_seconds=max_seconds,
                on_sample=on_sample,
            )
            admin.append(await admin_instances(gw.url, gw.key))
        for name, rate in zip(names, counter_hits(before, await prefix_counters(urls)), strict=True):
            hits[name].append(rate)
        runs.append(run)
        summaries.append(summarize(scenario.label, run.samples, names))
    rel = {
        str(r["name"]): float(r["relative_speed"])
        for r in ((admin[0] or {}).get("instances") or [])
        if r.get("relative_speed") is not None
    }
    samples: list[Sample] = [s for r in runs for s in r.samples if s.ok]
    per_instance = {n: _mean(v) for n, v in hits.items()}
    known = [v for v in per_instance.values() if not math.isnan(v)]
    hit = (
        _mean(known)
        if known
        else ratio(sum(s.cached_tokens for s in samples), sum(s.prompt_tokens for s in samples))
    )
    peak = peak_per_instance(runs[0].samples)
    evidence = Evidence(
        summaries[0],
        summaries[1],
        cap,
        low_cap,
        speeds,
        rel,
        hit,
        peak,
        ranges,
        per_instance if known else {},
    )
    return Diagnosis(decide(evidence, drop=drop, slow=slow), evidence, runs, admin)
