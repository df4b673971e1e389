"""How often ``taogate diagnose`` gets the verdict right: N runs on each fleet, verdicts counted.

Fleets (everything on 127.0.0.1):

- ``emulated-cached``: 4 emulated instances, all alike, prefix caching on. Right answer: balanced.
- ``emulated-slow``: 4 emulated instances, prefix caching on, the last one 2.5x slow. Right: slow, i3.
- ``real-same`` (with ``$TAOGATE_REAL_VLLM_VENV`` set): two real vLLM servers of the real tier's fast
  model, one per core, prefix caching on. Right: balanced.
- ``real-pair`` (same): the real tier's fast and slow cards. Right: slow, i1.

Each run is what ``taogate diagnose`` does (``taogate.bench.diagnose.diagnose`` with the CLI's
workload and defaults: probes, run A at cap 32, run B at cap 8, the same ``decide``). The emulated
fleets get the CLI's default load (64 prompts of ~4,096 tokens, 16 at a time) on a fresh fleet per
run, as ``taogate diagnose --emulate`` starts one. The real fleets get a smaller load (16 prompts of
~600 tokens, ``--real-tokens`` to change it, 4 at a time, ``max_tokens`` 8, ``--max-tokens`` to
change it: the tiny models' context is 4,096 tokens and two cores are slow), the one
tests/real/test_bench.py gives diagnose; the servers (``--max-num-seqs`` each, the real tier's 2 by
default) are started once per fleet through the real tier's own helpers (tests/real/home.py,
server.py) and serve every run.

    .venv/bin/python benchmarks/diagnose_runs.py                        # emulated fleets, 10 runs each
    TAOGATE_REAL_VLLM_VENV=/work/vllm-venv .venv/bin/python benchmarks/diagnose_runs.py   # and real
    .venv/bin/python benchmarks/diagnose_runs.py --runs 3 --fleets real-pair
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from pathlib import Path

from taogate.bench.cli import build_workload
from taogate.bench.diagnose import Diagnosis, diagnose
from taogate.bench.scenarios import fleet_capacity, fleet_configs
from taogate.bench.workloads import Workload
from taogate.emulator import run_fleet

REPO = Path(__file__).resolve().parents[1]
FLEETS = ("emulated-cached", "emulated-slow", "real-same", "real-pair")
SLOW_INDEX, SLOW_FACTOR = 3, 2.5
EMULATED_SIZE = 4
REAL_VENV_ENV = "TAOGATE_REAL_VLLM_VENV"
MAX_SECONDS = 120.0  # per run of the load (diagnose's own bound); the probes have their own


@dataclass(frozen=True)
class Fleet:
    """One fleet to diagnose: how to get its URLs for a run, the load, and the right answer."""

    name: str
    workload: Workload
    model: str
    probe_tokens: int
    expect: tuple[str, str | None]  # verdict kind, instance named
    fresh: Callable[[], AbstractAsyncContextManager[list[str]]] | None = None  # a new fleet per run


@dataclass
class Tally:
    fleet: Fleet
    verdicts: list[tuple[str, str | None]] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)

    def right(self) -> int:
        return sum(v == self.fleet.expect for v in self.verdicts)


def emulated(name: str, slow: dict[int, float], expect: tuple[str, str | None]) -> Fleet:
    configs = fleet_configs(EMULATED_SIZE, slow, prefix_caching=True)
    workload = build_workload(  # the CLI's defaults for --workload long-prompts
        "long-prompts",
        requests=None,
        concurrency=16,
        prompt_tokens=4096,
        max_tokens=16,
        rate=None,
        file=None,
        capacity=fleet_capacity(configs),
    )

    @contextlib.asynccontextmanager
    async def urls() -> AsyncIterator[list[str]]:
        async with run_fleet(configs) as fleet:
            yield list(fleet.urls)

    return Fleet(name, workload, configs[0].model, 4096, expect, fresh=urls)


def real_workload(prompt_tokens: int, max_tokens: int) -> Workload:
    return build_workload(
        "long-prompts",
        requests=16,
        concurrency=4,
        prompt_tokens=prompt_tokens,
        max_tokens=max_tokens,
        rate=None,
        file=None,
    )


@contextlib.asynccontextmanager
async def real_servers(labels: Sequence[str], max_num_seqs: int) -> AsyncIterator[list[str]]:
    """Real vLLM servers of the real tier's models (by spec name), one per core, until exit."""
    sys.path.insert(0, str(REPO))  # the real tier's helpers live under tests/, not in the package
    from tests.real.home import prepare
    from tests.real.server import ServerSpec, cpus, start_servers

    ready = prepare(print)
    cores = cpus()
    specs = [
        ServerSpec(
            f"{label}{n}", ready.models.dirs[label], cpu=cores[n % len(cores)], max_num_seqs=max_num_seqs
        )
        for n, label in enumerate(labels)
    ]
    started = time.monotonic()
    async with contextlib.AsyncExitStack() as stack:
        servers = await start_servers(ready.python, specs, ready.logs, stack, log=print)
        print(f"servers {', '.join(labels)} ready in {time.monotonic() - started:.1f} s")
        yield [s.url for s in servers]


def real(name: str, expect: tuple[str, str | None], prompt_tokens: int, max_tokens: int) -> Fleet:
    sys.path.insert(0, str(REPO))
    from tests.real.server import SERVED_MODEL

    return Fleet(name, real_workload(prompt_tokens, max_tokens), SERVED_MODEL, prompt_tokens, expect)


async def one_run(fleet: Fleet, urls: list[str]) -> tuple[Diagnosis, float]:
    started = time.monotonic()
    result = await diagnose(
        urls,
        fleet.workload,
        model=fleet.model,
        probe_tokens=fleet.probe_tokens,
        max_seconds=MAX_SECONDS,
        names=[f"i{n}" for n in range(len(urls))],  # the expected verdicts name them so
    )
    return result, time.monotonic() - started


def line(n: int, result: Diagnosis, seconds: float) -> str:
    v, ev = result.verdict, result.evidence
    speeds = ", ".join(f"{k} {s:,.0f}" for k, s in ev.probe_speeds.items())
    return (
        f"  run {n:2d}: {v.kind:8s} {v.instance or '-':3s} {seconds:5.1f} s | max/mean A "
        f"{ev.configured.max_over_mean:.2f} B {ev.lowered.max_over_mean:.2f} | probes tok/s: {speeds}"
        + ("" if v.kind == "balanced" or v.instance else f"\n           {v.headline}")
    )


async def run_fleet_n(fleet: Fleet, runs: int, urls: list[str] | None = None) -> Tally:
    tally = Tally(fleet)
    print(
        f"{fleet.name}: expect {fleet.expect[0]}" + (f" naming {fleet.expect[1]}" if fleet.expect[1] else "")
    )
    for n in range(1, runs + 1):
        if fleet.fresh is not None:
            async with fleet.fresh() as fresh:
                result, seconds = await one_run(fleet, fresh)
        else:
            assert urls is not None
            result, seconds = await one_run(fleet, urls)
        tally.verdicts.append((result.verdict.kind, result.verdict.instance))
        tally.seconds.append(seconds)
        print(line(n, result, seconds), flush=True)
    return tally


def summary(t: Tally) -> str:
    kinds = Counter(k for k, _ in t.verdicts)
    named = Counter(i for _, i in t.verdicts if i)
    s = t.seconds
    return (
        f"{t.fleet.name:16s} right {t.right()}/{len(t.verdicts)} | verdicts "
        + ", ".join(f"{k} {c}" for k, c in kinds.most_common())
        + " | named "
        + (", ".join(f"{k} {c}" for k, c in named.most_common()) or "-")
        + f" | run s: min {min(s):.1f} median {statistics.median(s):.1f} max {max(s):.1f}"
    )


async def main(
    runs: int, names: Sequence[str], real_tokens: int = 600, max_num_seqs: int = 2, max_tokens: int = 8
) -> int:
    has_real = bool(os.environ.get(REAL_VENV_ENV))
    tallies: list[Tally] = []
    for name in names:
        started = time.monotonic()
        if name == "emulated-cached":
            tallies.append(await run_fleet_n(emulated(name, {}, ("balanced", None)), runs))
        elif name == "emulated-slow":
            fleet = emulated(name, {SLOW_INDEX: SLOW_FACTOR}, ("slow", f"i{SLOW_INDEX}"))
            tallies.append(await run_fleet_n(fleet, runs))
        elif not has_real:
            print(f"{name}: skipped (set {REAL_VENV_ENV} to the vLLM venv)")
            continue
        else:
            labels = ("fast", "fast") if name == "real-same" else ("fast", "slow")
            expect = ("balanced", None) if name == "real-same" else ("slow", "i1")
            fleet = real(name, expect, real_tokens, max_tokens)
            async with real_servers(labels, max_num_seqs) as urls:
                tallies.append(await run_fleet_n(fleet, runs, urls))
        print(f"{name}: {time.monotonic() - started:.0f} s in all\n", flush=True)
    print("summary (diagnose's default verdict rule; loads as in the module docstring):")
    for t in tallies:
        print("  " + summary(t))
    return 0 if all(t.right() == len(t.verdicts) for t in tallies) else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10, help="diagnose runs per fleet")
    parser.add_argument("--fleets", nargs="+", choices=FLEETS, default=list(FLEETS))
    parser.add_argument("--max-tokens", type=int, default=8, help="max_tokens of the real fleets' load")
    parser.add_argument(
        "--max-num-seqs",
        type=int,
        default=2,
        help="each real server's --max-num-seqs (the real tier's 2 makes requests queue inside vLLM)",
    )
    parser.add_argument(
        "--real-tokens",
        type=int,
        default=600,
        help="diagnose's --prompt-tokens on the real fleets; its filler runs several times longer on the "
        "tiny models' tokenizer, so much past the default overflows their 4,096-token context (400s)",
    )
    args = parser.parse_args()
    sys.exit(asyncio.run(main(args.runs, args.fleets, args.real_tokens, args.max_num_seqs, args.max_tokens)))
