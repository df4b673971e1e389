"""Virtual-time replay of the long-prompt load (caching off) and mixed traffic on the emulator's
engine model: no HTTP, no CPU noise, seconds to run (``benchmarks/dispatch.py --oracle SEEDS``).

Rows: the pooled bound; an oracle that knows the exact prefill left on every instance and sends
each request where its first token comes soonest; and taogate's least_busy on views built from the
true state, with the decode pace learned from finished streams as the gateway learns it. It says
what such dispatchers reach on this fleet, for exploring policies fast; live runs judge.

``matrix_table`` replays the matrix's own mixed cells (their arrivals, per seed) and adds a floor
for any dispatcher of separate instances: the long prompts alone placed by the oracle, the short
ones counted at their idle TTFT. A long prompt is prefilled by one instance at one instance's
speed, where the pooled bound prefills it at the fleet's; that floor is what no placement avoids.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics

from rich.table import Table

from taogate.bench import matrix, workloads
from taogate.bench.matrix import Cell
from taogate.bench.report import percentile
from taogate.bench.scenarios import fleet_configs, instance_capacity, pooled_config
from taogate.bench.workloads import RequestSpec
from taogate.dispatch.admission import decide
from taogate.dispatch.policy import LeastBusy
from taogate.dispatch.types import InstanceView, RequestFacts, Send
from taogate.emulator.config import EmulatorConfig
from taogate.emulator.engine import Engine, EngineConfig, EngineRequest, StepPlan

SLOW = 3


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


def _simulate(
    configs: list[EmulatorConfig], wl: workloads.Workload, how: str, *, floor: float | None = None
) -> tuple[float, float]:
    """p99 TTFT and mean latency of ``wl`` (open loop, (b)) over ``configs`` in virtual time.
    ``floor``: replay only the long prompts and count each short one at this TTFT (mean latency
    then over the long ones)."""
    replay = _Replay(configs, how)
    specs: list[RequestSpec] = list(wl.requests)
    shorts = 0
    if floor is not None:
        specs = [r for r in wl.requests if r.group != "short"]
        shorts = len(wl.requests) - len(specs)
    arrivals = sorted(specs, key=lambda r: r.at or 0.0)
    i = 0
    while i < len(arrivals) or replay.next_step() < math.inf:
        if i < len(arrivals) and (arrivals[i].at or 0.0) <= replay.next_step():
            spec = arrivals[i]
            i += 1
            size = spec.approx_tokens + 8  # "Request N of a mixed load. " + body
            replay.send(f"r{spec.index}", size, spec.max_tokens, spec.at or 0.0)
            continue
        replay.step()
    ttfts = [replay.first[r] - replay.born[r] for r in replay.born] + [floor or 0.0] * shorts
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
    size = args.prompt_tokens + 8  # the long prompt's body plus " request number N"
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


def matrix_table(seeds: int) -> Table:
    """The matrix's mixed cells in virtual time, per arrival seed: p99 TTFT x the pooled bound for
    the floor of separate instances (long prompts alone, oracle-placed), the oracle and least_busy."""
    t = Table(
        title="the matrix's mixed cells in virtual time: p99 TTFT x the pooled bound, per arrival seed",
        title_justify="left",
    )
    for col in ("cell", "seed", "bound p99 s", "floor x", "oracle x", "least_busy x"):
        t.add_column(col, justify="left" if col == "cell" else "right")
    for base in (c for c in matrix.FULL if not c.hot):
        ratios: list[tuple[float, float, float]] = []
        for seed in range(seeds):
            cell: Cell = dataclasses.replace(base, seed=seed)
            configs, wl = matrix.configs(cell), matrix.workload(cell)
            short = min(r.approx_tokens for r in wl.requests) + 8
            idle = min((c.step_overhead + short / c.prefill_tokens_per_s) * c.slowdown for c in configs)
            bound, _ = _simulate([pooled_config(configs)], wl, "oracle")
            row = (
                _simulate(configs, wl, "oracle", floor=idle)[0] / bound,
                _simulate(configs, wl, "oracle")[0] / bound,
                _simulate(configs, wl, "least_busy")[0] / bound,
            )
            ratios.append(row)
            t.add_row(base.name, str(seed), f"{bound:.3f}", *(f"{x:.2f}" for x in row))
        means = [statistics.mean(r[k] for r in ratios) for k in range(3)]
        t.add_row(base.name, "mean", "", *(f"{x:.2f}" for x in means), end_section=True)
    return t
