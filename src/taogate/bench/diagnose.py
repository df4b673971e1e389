"""Is it dispatch, one slow instance, or nothing? The queue-cap bisection, automated.

``diagnose``: (1) **probe** each instance alone, straight to its URL: one ~4,096-token prompt with a
unique salt, ``max_tokens`` 1, twice; its prefill speed is ``prompt_tokens / TTFT`` of the faster try
(nothing else runs, so queueing cannot make it look slow). (2) **Run A**: the load through a fresh
loopback gateway with the configured strategy and cap. (3) **Run B**: the same load, new salt (no
cache reuse), with ``max_queue_per_instance`` lowered to ``low_cap`` (8). (4) Evidence: per-instance
completion times of both runs and each gateway's learned ``relative_speed``.

``decide`` (pure), first match wins:

- **dispatch** (exit 1): ``max latency(A) / max latency(B) >= drop`` (1.5): the lower cap fixed it, so
  requests piled up in one queue. Not when run A never had more than ``low_cap`` on one instance (the
  cap could not bind: the difference is noise), nor when a probed-slow instance already got under
  0.75x its fair share of run A (dispatch routes around it: the verdict is the instance's).
- **slow** (exit 2): the lower cap did not help, and an instance's probed speed is below ``slow``
  (0.6) x the fleet's median (without probes: the gateway's learned ``relative_speed``).
- **balanced** (exit 0): run A's max/mean is within ``IMBALANCE_RATIO`` (2).
- **inside** (exit 2): still over 2x with no slow instance and no help from the cap: look inside vLLM
  (AllReduce, data movement; or hits against misses when the prefix-cache hit rate is high).
- **error** (exit 3): a run had no successful request, or there was nothing to probe.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from taogate.app import serve_gateway
from taogate.bench.report import IMBALANCE_RATIO, Summary, ratio, summarize
from taogate.bench.runner import Run, Sample, Target, run_load
from taogate.bench.scenarios import Scenario, admin_instances, gateway_settings
from taogate.bench.workloads import RequestSpec, Workload, filler

__all__ = [
    "DROP",
    "EXIT_CODES",
    "SLOW",
    "Diagnosis",
    "Evidence",
    "Verdict",
    "decide",
    "diagnose",
    "peak_per_instance",
    "probe_speeds",
    "salted",
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
    probe_speeds: Mapping[str, float] = field(default_factory=dict)  # own prefill tokens/s, alone
    relative_speed: Mapping[str, float] = field(default_factory=dict)  # the gateway's learned view
    cache_hit_rate: float = math.nan
    peak_per_instance: int | None = None  # most requests in flight on one instance in run A


@dataclass(frozen=True, slots=True)
class Verdict:
    kind: VerdictKind
    headline: str
    evidence: tuple[str, ...]
    instance: str | None = None

    @property
    def exit_code(self) -> int:
        return EXIT_CODES[self.kind]


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
        lines.append(
            "own prefill speed, probed alone (tokens/s): "
            + ", ".join(f"{k} {v:,.0f}" for k, v in ev.probe_speeds.items())
        )
    if ev.relative_speed:
        lines.append(
            "gateway's learned relative speed: "
            + ", ".join(f"{k} {v:.2f}" for k, v in ev.relative_speed.items())
        )
    slowest = _slowest(ev.probe_speeds or ev.relative_speed, slow)
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
    if a.max_over_mean <= IMBALANCE_RATIO:
        return Verdict(
            "balanced",
            f"balanced: max/mean {a.max_over_mean:.2f} is within the max/mean <= {IMBALANCE_RATIO:g} rule "
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
        f"imbalance remains (max/mean {a.max_over_mean:.2f}) but not from dispatch or one slow "
        "instance: look inside vLLM (AllReduce, data movement)",
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


def salted(workload: Workload, salt: str) -> Workload:
    """The same workload with ``salt`` in front of every prompt (a fresh prefix: no cache reuse)."""

    def one(spec: RequestSpec) -> RequestSpec:
        if spec.system is not None:
            return replace(spec, system=f"{salt} {spec.system}")
        return replace(spec, prompt=f"{salt} {spec.prompt}")

    return replace(workload, requests=tuple(one(s) for s in workload.requests))


async def probe_speeds(
    urls: Sequence[str],
    names: Sequence[str],
    *,
    model: str,
    key: str = "",
    prompt_tokens: int = 4096,
    tries: int = 2,
) -> dict[str, float]:
    """Each instance alone: prompt tokens / TTFT of its best try (0 when every try failed)."""
    out: dict[str, float] = {}
    body = filler(prompt_tokens)
    for url, name in zip(urls, names, strict=True):
        best = 0.0
        for t in range(tries):
            spec = RequestSpec(t, f"Probe {name} {t} {id(out)}. {body}", 1, approx_tokens=prompt_tokens)
            run = await run_load(
                [Target(url + "/v1", key, name)], Workload("probe", (spec,), 1), model, max_seconds=60
            )
            s = run.samples[0]
            if s.ok and s.ttft:
                best = max(best, (s.prompt_tokens or prompt_tokens) / s.ttft)
        out[name] = best
    return out


@dataclass(slots=True)
class Diagnosis:
    verdict: Verdict
    evidence: Evidence
    runs: list[Run]
    admin: list[dict[str, Any] | None]


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
) -> Diagnosis:
    """Probe, run with ``cap`` and with ``low_cap`` through loopback gateways, and decide."""
    names = [f"i{n}" for n in range(len(urls))]
    speeds = (
        await probe_speeds(urls, names, model=model, key=key, prompt_tokens=probe_tokens) if probe else {}
    )
    runs: list[Run] = []
    admin: list[dict[str, Any] | None] = []
    summaries: list[Summary] = []
    for tag, limit in (("A", cap), ("B", low_cap)):
        scenario = Scenario(f"{strategy}, cap {limit}", "gateway", strategy, max_queue=limit)
        async with serve_gateway(gateway_settings(urls, scenario, names=names)) as gw:
            run = await run_load(
                [Target(gw.api_base, gw.key)],
                salted(workload, f"Diagnose run {tag} {id(runs)}."),
                model,
                label=scenario.label,
                max_seconds=max_seconds,
                on_sample=on_sample,
            )
            admin.append(await admin_instances(gw.url, gw.key))
        runs.append(run)
        summaries.append(summarize(scenario.label, run.samples, names))
    rel = {
        str(r["name"]): float(r["relative_speed"])
        for r in ((admin[0] or {}).get("instances") or [])
        if r.get("relative_speed") is not None
    }
    samples: list[Sample] = [s for r in runs for s in r.samples if s.ok]
    hit = ratio(sum(s.cached_tokens for s in samples), sum(s.prompt_tokens for s in samples))
    peak = peak_per_instance(runs[0].samples)
    evidence = Evidence(summaries[0], summaries[1], cap, low_cap, speeds, rel, hit, peak)
    return Diagnosis(decide(evidence, drop=drop, slow=slow), evidence, runs, admin)
