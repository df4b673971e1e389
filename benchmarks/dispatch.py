"""Dispatch benchmark: a scenario matrix (``taogate.bench.matrix``), each cell with the same rows.

Rows per cell, each on a fresh emulated fleet (the fleet, the gateway and this load generator each
in a process of their own, on 127.0.0.1): round_robin; least_requests (fewest requests in flight,
as nginx's ``least_conn``); taogate's default configuration; the default with prefix affinity off
(a feature turned off: the default must not lose to it); and the pooled bound (one instance with
the fleet's summed speed, batch slots and KV cache, which no dispatcher can beat). With ``--peers``,
the peer routers too (``peers.py``: sglang-router and vllm-router cache_aware, nginx least_conn), on
the same fleet and the same load; the summary then sets the default against the best of them.
"slow peak" is the most requests the slow card held at once (the emulators' own records): a wave
piled onto it shows there, against a fair share of the clients over the instances.

Prints one table per cell, then the worst cells for the default against least_requests
(throughput ratio, p99 latency ratio, p99 TTFT, hit rate) and against its feature-off row, with
the gateway's RSS and its cache model / KV index sizes at the end of each cell. ``--noise N``
repeats the first cell's least_requests and default rows N times and prints their spread: the
run-to-run noise the comparisons must be read against.

    .venv/bin/python benchmarks/dispatch.py              # the quick subset, minutes
    .venv/bin/python benchmarks/dispatch.py --full       # the whole matrix
    .venv/bin/python benchmarks/dispatch.py --cells "8 hot, half cache" --noise 3
    .venv/bin/python benchmarks/dispatch.py --cells "waves, cold, half cache" --peers
    .venv/bin/python benchmarks/dispatch.py --oracle 6 --cells none   # virtual-time replay only
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import math
import os
import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import peers
from dispatch_oracle import closed_oracle_table, matrix_table, oracle_table
from rich.console import Console
from rich.table import Table

from taogate.bench import matrix, workloads
from taogate.bench.isolated import fleet_process, fleet_stats
from taogate.bench.matrix import Cell
from taogate.bench.render import write_json
from taogate.bench.report import summarize
from taogate.bench.runner import Target, run_load
from taogate.bench.scenarios import Outcome, Scenario, fleet_capacity, fleet_configs, run_scenario
from taogate.emulator.config import EmulatorConfig
from taogate.serving import loop_factory

for _name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
    os.environ.pop(_name, None)

BASELINE = "least_requests"
DEFAULT = "taogate default"
ROWS = (
    Scenario("round_robin", "gateway", "round_robin"),
    Scenario(BASELINE, "gateway", "least_requests"),
    Scenario(DEFAULT, "gateway", "least_busy", prefix_affinity=True),
    Scenario("default, affinity off", "gateway", "least_busy", prefix_affinity=False),
    Scenario("pooled bound", "pooled"),
)


@dataclass(slots=True)
class Row:
    """One row's figures."""

    label: str
    rps: float  # successful requests per second over the run's span
    p99: float
    max: float
    ttft_p99: float
    hit: float
    errors: int
    on_slow: float  # share of requests on slow cards
    slow_peak: int  # most requests the slow cards held at once
    rss_mib: float
    cache_entries: int  # sum over instances: the cache model's entries
    kv_blocks: int


def _f(value: float, fmt: str = ".2f") -> str:
    return "-" if math.isnan(value) else format(value, fmt)


def slow_peak(stats: Sequence[dict[str, Any]], cell: Cell) -> int:
    """The most requests the cell's slow cards held at once, from the emulators' own records."""
    marks: list[tuple[float, int]] = []
    for i, _ in cell.slow:
        if i >= len(stats):
            continue
        for r in stats[i].get("records", []):
            if r.get("arrival") is not None and r.get("finish") is not None:
                marks += [(float(r["arrival"]), 1), (float(r["finish"]), -1)]
    peak = now = 0
    for _, step in sorted(marks):
        now += step
        peak = max(peak, now)
    return peak


def row_of(o: Outcome, cell: Cell) -> Row:
    s = o.summary
    slow = {f"i{i}" for i, _ in cell.slow}
    if s.per_instance:
        on_slow = sum(v.count for n, v in s.per_instance.items() if n in slow) / max(1, s.ok)
    else:  # a peer router: the instances' own counts
        done = [int(st.get("completed", 0)) for st in o.emulator]
        on_slow = sum(done[i] for i, _ in cell.slow if i < len(done)) / max(1, sum(done))
    rows = (o.admin or {}).get("instances", [])
    return Row(
        o.scenario.label,
        s.requests_per_s,
        s.latency.p99,
        s.latency.max,
        s.ttft.p99,
        o.cache_hit_rate,
        sum(s.errors.values()),
        on_slow,
        slow_peak(o.emulator, cell),
        o.gateway_rss / 2**20,
        sum(int(r.get("cache_entries", 0)) for r in rows),
        sum(int(r.get("kv_index_blocks", 0)) for r in rows),
    )


async def run_peer(
    name: str, wl: workloads.Workload, configs: Sequence[EmulatorConfig], max_seconds: float
) -> Outcome:
    """One peer router's row: a fresh fleet in a process of its own, the peer in front of it."""
    names = [f"i{n}" for n in range(len(configs))]
    async with contextlib.AsyncExitStack() as stack:
        urls = await stack.enter_async_context(fleet_process(configs))
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="taogate-peer-")))
        url = await stack.enter_async_context(peers.peer(name, urls, workdir))
        run = await run_load(
            [Target(url + "/v1", "")], wl, configs[0].model, label=name, max_seconds=max_seconds
        )
        stats = await fleet_stats(urls)
    summary = summarize(name, run.samples, names)
    summary.per_instance.clear()  # the samples cannot say which instance served them
    return Outcome(Scenario(name, "direct"), run, summary, None, stats)


def median_row(rows: Sequence[Row]) -> Row:
    """One row from several runs of it: the median of each figure (``--rounds``)."""
    first = rows[0]
    if len(rows) == 1:
        return first
    values: dict[str, Any] = {"label": first.label}
    for f in dataclasses.fields(Row):
        if f.name != "label":
            mid = statistics.median(getattr(r, f.name) for r in rows)
            values[f.name] = type(getattr(first, f.name))(mid)
    return Row(**values)


async def run_cell(console: Console, cell: Cell, args: argparse.Namespace) -> list[Row]:
    """Every row of the cell (peers too with ``--peers``), ``--rounds`` times with the rows taking
    turns, so a slow spell of a shared machine falls on all of them alike; medians per figure."""
    configs = matrix.configs(cell)
    wl = matrix.workload(cell)
    labels: list[str] = []
    for scenario in ROWS:
        if not args.rows or scenario.label in args.rows or scenario.kind == "pooled":
            labels.append(scenario.label)
    for name in peers.PEERS if args.peers else ():
        if args.rows and name not in args.rows:
            continue
        if peers.available(name):
            labels.append(name)
        else:
            console.print(f"  {cell.name}: {name} skipped (not installed)")
    runs: dict[str, list[Row]] = {label: [] for label in labels}
    for _ in range(max(1, args.rounds)):
        for label in labels:
            t = time.perf_counter()
            ours = next((s for s in ROWS if s.label == label), None)
            if ours is not None:
                outcome = await run_scenario(
                    ours, wl, configs=configs, max_seconds=args.max_seconds, isolated=True
                )
            else:
                outcome = await run_peer(label, wl, configs, args.max_seconds)
            row = row_of(outcome, cell)
            console.print(f"  {cell.name}: {label} in {time.perf_counter() - t:.1f}s, {row.rps:.1f} req/s")
            runs[label].append(row)
    return [median_row(rows) for rows in runs.values()]


def cell_table(cell: Cell, rows: list[Row]) -> Table:
    t = Table(title=f"{cell.name}: {cell.describe()}", title_justify="left")
    cols = (
        "dispatch",
        "req/s",
        "x least_req",
        "p99 s",
        "max s",
        "TTFT p99 s",
        "hit rate",
        "on slow",
        "slow peak",
        "errors",
    )
    for col in (*cols, "gw RSS MiB", "cache entries", "KV blocks"):
        t.add_column(col, justify="left" if col == "dispatch" else "right")
    base = next((r for r in rows if r.label == BASELINE), None)
    for r in rows:
        t.add_row(
            r.label,
            _f(r.rps, ".1f"),
            _f(r.rps / base.rps) if base and base.rps else "-",
            _f(r.p99),
            _f(r.max),
            _f(r.ttft_p99, ".3f"),
            _f(r.hit),
            f"{r.on_slow:.0%}",
            str(r.slow_peak),
            str(r.errors),
            _f(r.rss_mib, ".0f") if r.rss_mib else "-",
            str(r.cache_entries) if r.rss_mib else "-",
            str(r.kv_blocks) if r.rss_mib else "-",
        )
    return t


def _by(rows: list[Row], label: str) -> Row | None:
    return next((r for r in rows if r.label == label), None)


def summary_table(results: list[tuple[Cell, list[Row]]]) -> Table:
    """Every cell, worst first: the default against least_requests and against its feature-off row."""
    t = Table(title="the default against least_requests (and against affinity off), worst cell first")
    cols = ("cell", "tput x least_req", "p99 x least_req", "TTFT p99 s", "x pooled", "hit rate")
    for col in (*cols, "tput x affinity off", "p99 x affinity off"):
        t.add_column(col, justify="left" if col == "cell" else "right")
    lines = []
    for cell, rows in results:
        d, b, off, pooled = (
            _by(rows, x) for x in (DEFAULT, BASELINE, "default, affinity off", "pooled bound")
        )
        if d is None or b is None:
            continue
        tput = d.rps / b.rps if b.rps else math.nan
        p99 = d.p99 / b.p99 if b.p99 else math.nan
        lines.append(
            (
                tput,
                [
                    cell.name,
                    _f(tput),
                    _f(p99),
                    _f(d.ttft_p99, ".3f"),
                    _f(d.ttft_p99 / pooled.ttft_p99) if pooled and pooled.ttft_p99 else "-",
                    _f(d.hit),
                    _f(d.rps / off.rps) if off and off.rps else "-",
                    _f(d.p99 / off.p99) if off and off.p99 else "-",
                ],
            )
        )
    for _, cols_ in sorted(lines, key=lambda x: x[0]):
        t.add_row(*cols_)
    return t


def peer_table(results: list[tuple[Cell, list[Row]]]) -> Table | None:
    """Every cell with peer rows, worst first: the default's p99 against the better cache-aware
    peer's, its throughput and TTFT p99 against the best peer's, hit rates, the slow card's peak."""
    t = Table(title="the default against the peers, worst cell first (p99 ratio)")
    cols = ("cell", "p99 x best cache_aware", "tput x best peer", "TTFT p99 x best peer")
    for col in (*cols, "hit: default", "best peer", "slow peak: default", "peers"):
        t.add_column(col, justify="left" if col == "cell" else "right")
    lines = []
    for cell, rows in results:
        d = _by(rows, DEFAULT)
        ps = [r for r in rows if r.label in peers.PEERS and r.rps > 0]
        aware = [r for r in ps if "cache_aware" in r.label]
        if d is None or not ps or not aware:
            continue
        p99 = d.p99 / min(r.p99 for r in aware)
        lines.append(
            (
                p99,
                [
                    cell.name,
                    _f(p99),
                    _f(d.rps / max(r.rps for r in ps)),
                    _f(d.ttft_p99 / min(r.ttft_p99 for r in ps)),
                    _f(d.hit),
                    _f(max(r.hit for r in ps)),
                    str(d.slow_peak),
                    " ".join(str(r.slow_peak) for r in ps),
                ],
            )
        )
    if not lines:
        return None
    for _, cols_ in sorted(lines, key=lambda x: -x[0]):
        t.add_row(*cols_)
    return t


async def noise(console: Console, cell: Cell, times: int, args: argparse.Namespace) -> Table:
    """The first cell's least_requests and default rows ``times`` times each: their spread."""
    t = Table(title=f"run-to-run noise: {cell.name}, {times} runs per row", title_justify="left")
    for col in ("dispatch", "req/s runs", "spread (max/min - 1)", "p99 s runs", "spread"):
        t.add_column(col, justify="left" if col == "dispatch" else "right")
    wl, configs = matrix.workload(cell), matrix.configs(cell)
    for scenario in (s for s in ROWS if s.label in (BASELINE, DEFAULT)):
        rows = []
        for _ in range(times):
            o = await run_scenario(scenario, wl, configs=configs, max_seconds=args.max_seconds, isolated=True)
            rows.append(row_of(o, cell))
        rps, p99 = [r.rps for r in rows], [r.p99 for r in rows]
        t.add_row(
            scenario.label,
            " ".join(f"{v:.1f}" for v in rps),
            f"{max(rps) / min(rps) - 1:.1%}",
            " ".join(f"{v:.2f}" for v in p99),
            f"{max(p99) / min(p99) - 1:.1%}",
        )
        console.print(f"  noise: {scenario.label}: median {statistics.median(rps):.1f} req/s")
    return t


async def main(args: argparse.Namespace) -> dict[str, Any]:
    console = Console(width=170)
    if args.oracle:
        configs = fleet_configs(4, {3: args.slow_factor})
        rate = 0.7 * fleet_capacity(configs) / workloads.mixed_mean_tokens()
        console.print(closed_oracle_table(args))
        console.print(oracle_table(args, rate))
        console.print(matrix_table(args.oracle))
    cells = matrix.FULL if args.full else matrix.QUICK
    if args.cells:
        cells = tuple(c for c in matrix.FULL if c.name in args.cells)
    t0 = time.perf_counter()
    results: list[tuple[Cell, list[Row]]] = []
    for cell in cells:
        console.print(f"[bold]{cell.name}[/bold]: {cell.describe()}")
        rows = await run_cell(console, cell, args)
        results.append((cell, rows))
        console.print(cell_table(cell, rows))
    if results:
        console.print(summary_table(results))
        if (table := peer_table(results)) is not None:
            console.print(table)
    if args.noise and cells:
        console.print(await noise(console, cells[0], args.noise, args))
    console.print(f"total {time.perf_counter() - t0:.0f}s")
    return {cell.name: [dataclasses.asdict(r) for r in rows] for cell, rows in results}


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--full", action="store_true", help="the whole matrix (default: the quick subset)")
    p.add_argument("--cells", type=lambda v: v.split(";"), default=[], help="';'-separated cell names")
    p.add_argument(
        "--rows", type=lambda v: v.split(";"), default=[], help="';'-separated rows to run (pooled always)"
    )
    p.add_argument(
        "--noise", type=int, default=0, metavar="N", help="repeat the first cell's main rows N times"
    )
    p.add_argument("--max-seconds", type=float, default=120.0, help="cap per run")
    p.add_argument("--peers", action="store_true", help="also the peer routers (peers.py), where installed")
    p.add_argument("--rounds", type=int, default=1, help="run every row this many times, in turns; medians")
    p.add_argument("--oracle", type=int, default=0, metavar="SEEDS", help="virtual-time replay first")
    p.add_argument("--requests", type=int, default=64, help="--oracle: long-prompt requests")
    p.add_argument("--concurrency", type=int, default=16, help="--oracle: requests in flight")
    p.add_argument("--prompt-tokens", type=int, default=4096, help="--oracle: prompt size")
    p.add_argument("--mixed-requests", type=int, default=300, help="--oracle: mixed requests")
    p.add_argument("--slow-factor", type=float, default=2.5, help="--oracle: the slow card's slowdown")
    p.add_argument("--json", help="write every row's figures here")
    return p.parse_args()


if __name__ == "__main__":
    ns = parse()
    with asyncio.Runner(loop_factory=loop_factory()) as runner:  # uvloop, as the isolated servers run
        payload = runner.run(main(ns))
    if ns.json:
        write_json(Path(ns.json), payload)
