"""Dispatch benchmark (issue 4's Proof): round_robin vs least_busy vs least_busy+affinity vs the pooled bound.

An emulated fleet of 4 with one instance 2.5x slower (every row on a fresh fleet, on 127.0.0.1; the
fleet, the gateway and this load generator each in a process of their own), three workloads:

(a) the article's load (64 x ~4,096 tokens, 16 at a time, max_tokens 16), prefix caching OFF and ON;
(b) mixed traffic: 80% ~200-token / 20% ~8,000-token prompts, streaming, Poisson arrivals at 70% of the
    fleet's prefill capacity (computed from the emulator's cost model, not guessed);
(c) shared prefixes: 8 long system prompts, many short questions, prefix caching on.

Prints one table per workload and the issue's targets next to the measured figures (PASS/FAIL).
Everything is sized by flags; the defaults take about 2-3 minutes on 2 cores.

    .venv/bin/python benchmarks/dispatch.py [--requests 64] [--mixed-requests 300] [--json out.json]
    .venv/bin/python benchmarks/dispatch.py --only a_on --rows least_busy   # one part, to iterate
    .venv/bin/python benchmarks/dispatch.py --oracle 6 --only none   # (a), (b) in virtual time, seconds

``--oracle`` replays (a) caching off (closed loop) and (b)'s arrivals on the emulator's engine model in
virtual time (no HTTP, no CPU noise): the pooled bound, a dispatcher that knows the exact prefill left
on every instance and sends each request where its first token comes soonest, and taogate's
least_busy on views built from the true state. It says what such dispatchers reach on this fleet,
not what the gateway measured.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from taogate.bench import workloads
from taogate.bench.render import plot_runs, run_payload, write_json
from taogate.bench.report import compare, load_spread, percentile
from taogate.bench.scenarios import (
    Outcome,
    Scenario,
    fleet_capacity,
    fleet_configs,
    instance_capacity,
    pooled_config,
    run_scenario,
)
from taogate.dispatch.admission import decide
from taogate.dispatch.policy import LeastBusy
from taogate.dispatch.types import InstanceView, RequestFacts, Send
from taogate.emulator.config import EmulatorConfig
from taogate.emulator.engine import Engine, EngineConfig, EngineRequest, StepPlan
from taogate.serving import loop_factory

for _name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
    os.environ.pop(_name, None)

ROWS = (
    Scenario("round_robin", "gateway", "round_robin"),
    Scenario("least_busy", "gateway", "least_busy"),
    Scenario("least_busy+affinity", "gateway", "least_busy", prefix_affinity=True),
    Scenario("pooled bound", "pooled"),
)
SLOW = 3
PARTS = ("a_off", "a_on", "b", "c")


def _f(value: float, fmt: str = ".2f") -> str:
    return "-" if math.isnan(value) else format(value, fmt)


def _verdict(ok: bool) -> str:
    return "[green]PASS[/green]" if ok else "[red]FAIL[/red]"


async def run_rows(
    console: Console,
    name: str,
    wl: workloads.Workload,
    caching: bool,
    args: argparse.Namespace,
    base: EmulatorConfig | None = None,
) -> list[Outcome]:
    configs = fleet_configs(4, {SLOW: args.slow_factor}, prefix_caching=caching, base=base)
    out = []
    for row in ROWS:
        if args.rows and row.label not in args.rows and row.kind != "pooled":
            continue
        t = time.perf_counter()
        outcome = await run_scenario(
            row, wl, configs=configs, max_seconds=args.max_seconds, isolated=not args.in_process
        )
        counts = " ".join(f"{n}={s.count}" for n, s in sorted(outcome.summary.per_instance.items()))
        console.print(
            f"  {name}: {row.label} done in {time.perf_counter() - t:.1f}s "
            f"({outcome.summary.ok}/{outcome.summary.requests} ok; {counts})"
        )
        out.append(outcome)
    return out


def article_table(title: str, rows: list[Outcome]) -> Table:
    bound = rows[-1].summary
    t = Table(title=title, title_justify="left")
    for col in ("dispatch", "mean s", "max s", "min s", "max/mean", "prompt tok/s", "% of bound", "errors"):
        t.add_column(col, justify="left" if col == "dispatch" else "right")
    for o in rows:
        s = o.summary
        t.add_row(
            o.scenario.label,
            _f(s.latency.mean),
            _f(s.latency.max),
            _f(s.latency.min),
            _f(s.max_over_mean),
            _f(s.prompt_tokens_per_s, ",.0f"),
            _f(100 * compare(s, bound)["throughput"], ".0f") + "%",
            str(sum(s.errors.values())),
        )
    return t


def mixed_table(title: str, rows: list[Outcome]) -> Table:
    bound = rows[-1].summary
    t = Table(title=title, title_justify="left")
    cols = ("dispatch", "TTFT p50 s", "TTFT p99 s", "mean s", "p99 s", "mean x bound", "TTFT p99 x bound")
    for col in (*cols, "errors"):
        t.add_column(col, justify="left" if col == "dispatch" else "right")
    for o in rows:
        s = o.summary
        r = compare(s, bound)
        t.add_row(
            o.scenario.label,
            _f(s.ttft.p50, ".3f"),
            _f(s.ttft.p99, ".3f"),
            _f(s.latency.mean),
            _f(s.latency.p99),
            _f(r["mean_latency"]),
            _f(r["p99_ttft"]),
            str(sum(s.errors.values())),
        )
    return t


def fast_names() -> list[str]:
    return [f"i{n}" for n in range(4) if n != SLOW]


def shared_table(title: str, rows: list[Outcome]) -> Table:
    t = Table(title=title, title_justify="left")
    for col in ("dispatch", "hit rate", "i0", "i1", "i2", f"i{SLOW} (slow)", "fast max/mean load", "mean s"):
        t.add_column(col, justify="left" if col == "dispatch" else "right")
    for o in rows:
        s = o.summary
        shares = [
            f"{s.per_instance[n].count} ({s.per_instance[n].share:.0%})" if n in s.per_instance else "-"
            for n in (*fast_names(), f"i{SLOW}")
        ]
        spread = load_spread(s.per_instance, fast_names()) if o.scenario.kind != "pooled" else math.nan
        t.add_row(o.scenario.label, _f(o.cache_hit_rate), *shares, _f(spread), _f(s.latency.mean))
    return t


def fast_within(o: Outcome, factor: float = 1.5) -> bool:
    """Every fast instance's request count within [mean/factor, mean*factor] of the fast mean."""
    counts = [o.summary.per_instance[n].count if n in o.summary.per_instance else 0 for n in fast_names()]
    mean = sum(counts) / len(counts)
    return mean > 0 and all(mean / factor <= c <= mean * factor for c in counts)


def targets(a_off: list[Outcome], a_on: list[Outcome], b: list[Outcome], c: list[Outcome]) -> Table:
    t = Table(
        title="issue 4 targets (fractions of the pooled bound measured in this run)", title_justify="left"
    )
    for col in ("workload", "target", "dispatch", "measured", "result"):
        t.add_column(col)

    def by(rows: list[Outcome], label: str) -> Outcome:
        return next(o for o in rows if o.scenario.label == label)

    for label in ("least_busy", "least_busy+affinity"):
        off, on = by(a_off, label), by(a_on, label)
        tp_off = compare(off.summary, a_off[-1].summary)["throughput"]
        tp_on = compare(on.summary, a_on[-1].summary)["throughput"]
        t.add_row(
            "(a) caching off", "throughput >= 90% of bound", label, f"{tp_off:.0%}", _verdict(tp_off >= 0.9)
        )
        t.add_row(
            "(a) caching on", "throughput >= 85% of bound", label, f"{tp_on:.0%}", _verdict(tp_on >= 0.85)
        )
        mm = off.summary.max_over_mean
        t.add_row("(a) caching off", "max/mean <= 1.5", label, _f(mm), _verdict(mm <= 1.5))
        r = compare(by(b, label).summary, b[-1].summary)
        t.add_row(
            "(b) mixed",
            "mean latency <= 1.25x bound",
            label,
            _f(r["mean_latency"]) + "x",
            _verdict(r["mean_latency"] <= 1.25),
        )
        t.add_row(
            "(b) mixed",
            "p99 TTFT <= 1.5x bound",
            label,
            _f(r["p99_ttft"]) + "x",
            _verdict(r["p99_ttft"] <= 1.5),
        )
        o = by(c, label)
        rr_hit = by(c, "round_robin").cache_hit_rate
        hit = o.cache_hit_rate
        t.add_row("(c) shared prefix", "hit rate >= 0.9", label, _f(hit), _verdict(hit >= 0.9))
        t.add_row(
            "(c) shared prefix",
            "hit rate >= 2x round_robin's",
            label,
            f"{hit:.2f} vs {rr_hit:.2f}",
            _verdict(hit >= 2 * rr_hit),
        )
        t.add_row(
            "(c) shared prefix",
            "each fast instance within 1.5x of mean load",
            label,
            ", ".join(
                str(o.summary.per_instance[n].count) for n in fast_names() if n in o.summary.per_instance
            ),
            _verdict(fast_within(o)),
        )
    rr_tp = compare(by(a_off, "round_robin").summary, a_off[-1].summary)["throughput"]
    t.add_row(
        "(a) caching off", "reference: round robin (~55% in the issue)", "round_robin", f"{rr_tp:.0%}", ""
    )
    return t


# --- (a) and (b) in virtual time: what a dispatcher that knows everything reaches ---------------------------


class _Sim:
    """One emulated engine stepped in virtual time, with the exact prefill left on each request."""

    def __init__(self, name: str, config: EmulatorConfig) -> None:
        self.name, self.config = name, config
        self.engine = Engine(EngineConfig.from_emulator(config))
        self.capacity = instance_capacity(config)
        self.plan: StepPlan | None = None
        self.plan_end = 0.0
        self.left: dict[str, int] = {}  # request -> prefill tokens not done yet
        self.booked: dict[str, int] = {}  # request -> whole prompt, until its first token
        self.inflight: set[str] = set()
        # Seconds per output token as the gateway learns it (SpeedEstimator.observe_completion: each
        # stream's mean pace after its first token, averaged with weight 0.2), so prefill chunks
        # interleaved with the decode count, as they do live; seeded with an idle step.
        self.tpot = (config.step_overhead + 8 / config.decode_tokens_per_s) * config.slowdown

    def start(self, now: float) -> None:
        if self.plan is None:
            self.plan = self.engine.schedule()
            self.plan_end = now + (self.plan.duration if self.plan else 0.0)

    def ttft_estimate(self, tokens: int) -> float:
        """Exact prefill ahead (FIFO chunked prefill at full batches) plus this prompt."""
        step = self.config.step_overhead * self.config.slowdown
        return step + (sum(self.left.values()) + tokens) / self.capacity

    def view(self) -> InstanceView:
        """What the gateway would see: exact queues, perfectly learned speed and fixed latency, and the
        decode pace learned from finished streams as the gateway learns it."""
        c = self.config
        return InstanceView(
            self.name,
            inflight=len(self.inflight),
            prefill_tokens=sum(self.booked.values()),
            prefilling=len(self.booked),
            decoding=len(self.inflight) - len(self.booked),
            speed=self.capacity,
            base_latency=c.step_overhead * c.slowdown,
            decode_seconds_per_token=self.tpot,
        )


class _Replay:
    """Instances stepped together in virtual time; requests placed by the oracle or by taogate's policy.

    ``how``: "oracle" sends each request where its first token comes soonest given the exact prefill
    left everywhere; "least_busy" asks taogate's own policy over views built from the true state.
    """

    def __init__(self, configs: list[EmulatorConfig], how: str) -> None:
        self.sims = [_Sim(f"i{n}", c) for n, c in enumerate(configs)]
        self.how = how
        self.policy = LeastBusy()
        self.ids = iter(range(10**9))
        self.born: dict[str, float] = {}
        self.first: dict[str, float] = {}
        self.done: dict[str, float] = {}
        self.placed: dict[str, str] = {}

    def send(self, rid: str, size: int, max_tokens: int, now: float) -> None:
        if self.how == "oracle":
            sim = min(self.sims, key=lambda s: s.ttft_estimate(size))
        else:
            facts = RequestFacts("m", size, long=size > 4096, max_tokens=max_tokens)
            sent = decide(facts, [s.view() for s in self.sims], self.policy)
            assert isinstance(sent, Send)
            sim = next(s for s in self.sims if s.name == sent.instance)
        sim.engine.add(EngineRequest(rid, [next(self.ids) for _ in range(size)], max_tokens))
        self.born[rid], self.placed[rid] = now, sim.name
        sim.left[rid] = sim.booked[rid] = size
        sim.inflight.add(rid)
        sim.start(now)

    def next_step(self) -> float:
        return min((s.plan_end for s in self.sims if s.plan), default=math.inf)

    def step(self) -> tuple[float, list[str]]:
        """Complete every step that ends next; returns the time and the requests that finished."""
        now, finished = self.next_step(), []
        for sim in self.sims:
            if sim.plan is None or sim.plan_end > now:
                continue
            for rid, chunk in sim.plan.prefill:
                sim.left[rid] = sim.left.get(rid, 0) - chunk
            for out in sim.engine.update(sim.plan):
                if out.index == 0:
                    self.first.setdefault(out.request_id, now)
                    sim.left.pop(out.request_id, None)
                    sim.booked.pop(out.request_id, None)
                if out.finish_reason is not None:
                    rid = out.request_id
                    self.done[rid] = now
                    sim.inflight.discard(rid)
                    finished.append(rid)
                    if out.index:  # tokens after the first: (tokens - 1)
                        sim.tpot += 0.2 * ((now - self.first[rid]) / out.index - sim.tpot)
            sim.plan = None
            sim.start(now)
        return now, finished

    def mean_latency(self) -> float:
        return sum(self.done[r] - self.born[r] for r in self.born) / len(self.born)


def _simulate(configs: list[EmulatorConfig], wl: workloads.Workload, how: str) -> tuple[float, float]:
    """p99 TTFT and mean latency of ``wl`` (open loop, (b)) over ``configs`` in virtual time."""
    replay = _Replay(configs, how)
    arrivals = sorted(wl.requests, key=lambda r: r.at or 0.0)
    i = 0
    while i < len(arrivals) or replay.next_step() < math.inf:
        if i < len(arrivals) and (arrivals[i].at or 0.0) <= replay.next_step():
            spec = arrivals[i]
            i += 1
            size = spec.approx_tokens + 8  # "Request N of a mixed load. " + body
            replay.send(f"r{spec.index}", size, spec.max_tokens, spec.at or 0.0)
            continue
        replay.step()
    ttfts = [replay.first[r] - replay.born[r] for r in replay.born]
    return percentile(ttfts, 99), replay.mean_latency()


def _simulate_closed(
    configs: list[EmulatorConfig], requests: int, concurrency: int, size: int, how: str
) -> tuple[float, float, float, int]:
    """(a), caching off, in virtual time: prompt tokens/s, mean and max latency, and the requests the
    slow instance got, for ``requests`` prompts of ``size`` tokens ``concurrency`` at a
    time (each finished request starts the next, as the benchmark's closed loop does)."""
    replay = _Replay(configs, how)
    sent = 0
    while sent < concurrency and sent < requests:
        replay.send(f"r{sent}", size, 16, 0.0)
        sent += 1
    while replay.next_step() < math.inf:
        now, finished = replay.step()
        for _ in finished:
            if sent < requests:
                replay.send(f"r{sent}", size, 16, now)
                sent += 1
    latencies = [replay.done[r] - replay.born[r] for r in replay.born]
    slow = sum(1 for name in replay.placed.values() if name == f"i{SLOW}")
    return requests * size / max(replay.done.values()), replay.mean_latency(), max(latencies), slow


def oracle_table(args: argparse.Namespace, rate: float) -> Table:
    """(b) on the emulator's engine model in virtual time (no HTTP, no CPU): the pooled bound, a
    dispatcher that knows every instance's exact prefill left, and taogate's policy on true state."""
    configs = fleet_configs(4, {SLOW: args.slow_factor})
    t = Table(
        title="(b) in virtual time: p99 TTFT (and mean latency) x the pooled bound, per arrival seed",
        title_justify="left",
    )
    for col in ("seed", "bound p99 s", "oracle: p99 x", "oracle: mean x", "least_busy: p99 x", "mean x"):
        t.add_column(col, justify="right")
    for seed in range(args.oracle):
        wl = workloads.mixed(args.mixed_requests, rate, seed=seed)
        p99, mean = _simulate([pooled_config(configs)], wl, "oracle")
        o99, omean = _simulate(configs, wl, "oracle")
        l99, lmean = _simulate(configs, wl, "least_busy")
        t.add_row(
            str(seed),
            f"{p99:.3f}",
            f"{o99 / p99:.2f}",
            f"{omean / mean:.2f}",
            f"{l99 / p99:.2f}",
            f"{lmean / mean:.2f}",
        )
    return t


def closed_oracle_table(args: argparse.Namespace) -> Table:
    """(a) caching off on the engine model in virtual time: what greedy dispatch reaches there."""
    configs = fleet_configs(4, {SLOW: args.slow_factor})
    size = args.prompt_tokens + 8  # the article's body plus " request number N"
    t = Table(
        title=f"(a) caching off in virtual time: {args.requests} x {size} tokens, "
        f"{args.concurrency} at a time",
        title_justify="left",
    )
    for col in ("dispatch", "% of bound", "mean s", "max s", "max/mean", "on the slow instance"):
        t.add_column(col, justify="right")
    rows = (
        ("pooled bound", [pooled_config(configs)], "oracle"),
        ("oracle", configs, "oracle"),
        ("least_busy", configs, "least_busy"),
    )
    bound = 0.0
    for label, cfgs, how in rows:
        tps, mean, worst, slow = _simulate_closed(cfgs, args.requests, args.concurrency, size, how)
        bound = bound or tps
        on_slow = "-" if len(cfgs) == 1 else str(slow)
        t.add_row(label, f"{tps / bound:.1%}", f"{mean:.2f}", f"{worst:.2f}", f"{worst / mean:.2f}", on_slow)
    return t


async def main(args: argparse.Namespace) -> dict[str, Any]:
    console = Console(width=150)
    configs = fleet_configs(4, {SLOW: args.slow_factor})
    capacity = fleet_capacity(configs)
    rate = args.mixed_load * capacity / workloads.mixed_mean_tokens()
    console.print(
        f"fleet: 4 emulated instances, i{SLOW} {args.slow_factor}x slower; prefill capacity "
        f"{capacity:,.0f} tokens/s (from the emulator's cost model); pooled bound: one instance with the "
        "fleet's summed speeds, batch slots and KV cache"
    )
    if args.oracle:
        console.print(closed_oracle_table(args))
        console.print(oracle_table(args, rate))
    t0 = time.perf_counter()
    only = set(args.only)
    article = workloads.long_prompts(args.requests, args.concurrency, args.prompt_tokens, 16)
    groups: dict[str, list[Outcome]] = {}
    if "a_off" in only:
        groups["a_off"] = await run_rows(console, "(a) caching off", article, False, args)
    if "a_on" in only:
        groups["a_on"] = await run_rows(console, "(a) caching on", article, True, args)
    if "b" in only:
        mixed = workloads.mixed(args.mixed_requests, rate, seed=args.seed)
        console.print(
            f"(b) mixed: {args.mixed_requests} requests at {rate:.1f}/s = {args.mixed_load:.0%} of capacity"
        )
        groups["b_mixed"] = await run_rows(console, "(b) mixed", mixed, False, args)
    if "c" in only:
        shared = workloads.shared_prefix(
            args.shared_requests, args.concurrency, system_tokens=args.system_tokens
        )
        # Optionally a KV cache too small to hold every system prompt on every instance.
        c_base = EmulatorConfig(kv_cache_tokens=args.kv_tokens) if args.kv_tokens else None
        groups["c_shared"] = await run_rows(console, "(c) shared prefix", shared, True, args, c_base)

    title = (
        f"(a) the article's load, {args.requests} x ~{args.prompt_tokens} tokens, "
        f"{args.concurrency} at a time"
    )
    if "a_off" in groups:
        console.print(article_table(f"{title}, prefix caching OFF", groups["a_off"]))
    if "a_on" in groups:
        console.print(article_table("(a) the same, prefix caching ON", groups["a_on"]))
    if "b_mixed" in groups:
        console.print(
            mixed_table(
                f"(b) mixed 80% ~200 / 20% ~8,000 tokens, Poisson {rate:.1f} req/s", groups["b_mixed"]
            )
        )
    if "c_shared" in groups:
        console.print(
            shared_table(
                f"(c) shared prefixes: 8 system prompts of ~{args.system_tokens} tokens, "
                f"{args.shared_requests} questions, prefix caching on",
                groups["c_shared"],
            )
        )
    if len(groups) == len(PARTS) and not args.rows:
        console.print(targets(groups["a_off"], groups["a_on"], groups["b_mixed"], groups["c_shared"]))
    console.print(f"total {time.perf_counter() - t0:.0f}s")
    if args.plot and "a_off" in groups:
        plot_runs(
            Path(args.plot), [o.run for o in groups["a_off"]], title="dispatch benchmark (a), caching off"
        )
        console.print(f"wrote {args.plot}")
    return {
        k: [run_payload(o.run, o.summary, hit_rate=o.cache_hit_rate) for o in v] for k, v in groups.items()
    }


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--requests", type=int, default=64, help="(a) requests per run")
    p.add_argument("--concurrency", type=int, default=16, help="(a), (c) requests in flight")
    p.add_argument("--prompt-tokens", type=int, default=4096, help="(a) prompt size")
    p.add_argument("--mixed-requests", type=int, default=300, help="(b) requests per run")
    p.add_argument("--mixed-load", type=float, default=0.7, help="(b) offered load, fraction of capacity")
    p.add_argument("--shared-requests", type=int, default=256, help="(c) requests per run")
    p.add_argument("--system-tokens", type=int, default=2000, help="(c) system prompt size")
    p.add_argument("--kv-tokens", type=int, default=0, help="(c) KV cache tokens per instance (0: default)")
    p.add_argument("--slow-factor", type=float, default=2.5, help="slowdown of the slow instance")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-seconds", type=float, default=120.0, help="cap per run")
    p.add_argument(
        "--only",
        type=lambda v: v.split(","),
        default=list(PARTS),
        help=f"comma-separated parts to run, of {','.join(PARTS)} (the targets table needs all of them)",
    )
    p.add_argument(
        "--rows",
        type=lambda v: v.split(","),
        default=[],
        help="comma-separated dispatch rows to run (the pooled bound always runs); default: all",
    )
    p.add_argument(
        "--oracle",
        type=int,
        default=0,
        metavar="SEEDS",
        help="also run (a) caching off, and (b) for this many arrival seeds, in virtual time on the engine "
        "model: the bound, "
        "a dispatcher knowing every instance's exact prefill left, taogate's policy on true state",
    )
    p.add_argument(
        "--in-process",
        action="store_true",
        help="run the emulated fleet and the gateway in this process (default: each in its own, so "
        "neither the gateway's nor the load generator's CPU slows the emulated engines; all on uvloop)",
    )
    p.add_argument("--json", help="write every run (summaries and samples) here")
    p.add_argument("--plot", help="write a PNG of (a) caching off here")
    return p.parse_args()


if __name__ == "__main__":
    ns = parse()
    with asyncio.Runner(loop_factory=loop_factory()) as runner:  # uvloop, as the isolated servers run
        payload = runner.run(main(ns))
    if ns.json:
        write_json(Path(ns.json), payload)
