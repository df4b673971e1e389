"""``taogate diagnose`` run many times on four fleets, its verdicts tallied.

Homogeneous fleets must come out balanced every time, fleets with a slow card must have that card
named every time: an emulated fleet of 4 with prefix caching on (then with instance 3 at 2.5x), and
real vLLM, two fast cards (then the fast and the slow card), built and started by the real tier's
harness. Run it under the machine-wide lock; it takes a quarter of an hour or so:

    TAOGATE_REAL_VLLM_VENV=/work/vllm-venv flock /tmp/taogate-heavy.lock \\
        .venv/bin/python -m tests.real.tally [--runs 10] [--only emulated|real]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import time
from collections import Counter
from collections.abc import Sequence

from taogate.bench.diagnose import diagnose
from taogate.bench.isolated import fleet_process
from taogate.bench.scenarios import fleet_configs
from taogate.bench.workloads import long_prompts
from taogate.serving import loop_factory
from tests.real.home import prepare
from tests.real.server import SERVED_MODEL, ServerSpec, cpus, start_servers

for _name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
    os.environ.pop(_name, None)


def verdict_of(kind: str, instance: str | None) -> str:
    return f"{kind} {instance}" if instance else kind


async def tally(label: str, urls: Sequence[str], runs: int, *, model: str, **kwargs: object) -> Counter[str]:
    seen: Counter[str] = Counter()
    for n in range(runs):
        started = time.monotonic()
        result = await diagnose(urls, model=model, **kwargs)  # type: ignore[arg-type]
        v = result.verdict
        seen[verdict_of(v.kind, v.instance)] += 1
        took = time.monotonic() - started
        print(f"  {label} run {n + 1}: {verdict_of(v.kind, v.instance)} ({took:.0f} s): {v.headline}")
    print(f"{label}: {dict(seen)}", flush=True)
    return seen


async def emulated(runs: int) -> dict[str, Counter[str]]:
    out = {}
    workload = long_prompts()  # diagnose's default: 64 x ~4,096 tokens, 16 at a time
    for label, slow in (
        ("emulated, 4 alike, caching on", None),
        ("emulated, i3 2.5x slow, caching on", {3: 2.5}),
    ):
        async with fleet_process(fleet_configs(4, slow, prefix_caching=True)) as urls:
            out[label] = await tally(label, urls, runs, model="emulated-model", workload=workload)
    return out


async def real(runs: int) -> dict[str, Counter[str]]:
    prepared = prepare(print)
    cores = cpus()
    # Sized for the tiny models (4,096-token context) and their speed on a CPU core.
    workload = long_prompts(16, 4, 600, 8)
    out = {}
    for label, second in (("real, fast + fast", "fast"), ("real, fast + slow", "slow")):
        specs = [
            ServerSpec("fast", prepared.models.dirs["fast"], cpu=cores[0]),
            ServerSpec(f"{second}-2", prepared.models.dirs[second], cpu=cores[1 % len(cores)]),
        ]
        async with contextlib.AsyncExitStack() as stack:
            servers = await start_servers(prepared.python, specs, prepared.logs, stack, log=print)
            urls = [s.url for s in servers]
            out[label] = await tally(
                label, urls, runs, model=SERVED_MODEL, workload=workload, probe_tokens=600
            )
    return out


async def main(args: argparse.Namespace) -> None:
    results: dict[str, Counter[str]] = {}
    if args.only in (None, "emulated"):
        results |= await emulated(args.runs)
    if args.only in (None, "real"):
        results |= await real(args.runs)
    print("\ntally (verdicts over runs):")
    for label, seen in results.items():
        print(f"  {label}: " + ", ".join(f"{k} {v}/{args.runs}" for k, v in seen.most_common()))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--only", choices=("emulated", "real"))
    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        runner.run(main(parser.parse_args()))
