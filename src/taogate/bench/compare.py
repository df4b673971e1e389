"""``bench --compare``: every configuration side by side in one run, on the same workload.

Rows: the user's own gateway (when a base URL is given), then ``scenarios.COMPARE`` (direct round
robin, then loopback gateways with round_robin, least_busy, least_busy + affinity), then the pooled
bound when the fleet is emulated. Each emulated row runs on a fresh fleet, and every row's prompts get
a salt of their own in front: on a real fleet, whose caches outlive a row, a later row would otherwise
be served from what the earlier rows left there and measure the prefix cache, not the dispatch.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping, Sequence

import httpx
from rich.console import Console

from taogate.bench.render import progress
from taogate.bench.report import summarize
from taogate.bench.runner import Target, run_load
from taogate.bench.scenarios import COMPARE, POOLED, Outcome, Scenario, run_scenario
from taogate.bench.workloads import Workload, salted
from taogate.emulator.config import EmulatorConfig

__all__ = ["run_compare", "run_target"]


async def run_target(
    target: Target,
    workload: Workload,
    *,
    model: str,
    label: str,
    console: Console,
    headers: Mapping[str, str] | None = None,
    max_requests: int | None = None,
    max_seconds: float = 300.0,
    http_timeout: httpx.Timeout | None = None,
) -> Outcome:
    """One run against an already running endpoint (the user's gateway), its prompts salted as
    every compare row's: what an earlier run left in the caches must not pass for dispatch."""
    total = len(workload.limited(max_requests).requests)
    with progress(console, label, total) as advance:
        run = await run_load(
            [target],
            salted(workload, f"Your gateway's run {secrets.token_hex(4)}."),
            model,
            label=label,
            headers=headers,
            max_requests=max_requests,
            max_seconds=max_seconds,
            http_timeout=http_timeout,
            on_sample=advance,
        )
    return Outcome(Scenario(label, "gateway"), run, summarize(label, run.samples))


async def run_compare(
    workload: Workload,
    *,
    console: Console,
    configs: Sequence[EmulatorConfig] | None = None,
    urls: Sequence[str] | None = None,
    names: Sequence[str] | None = None,
    instance_key: str = "",
    model: str = "emulated-model",
    headers: Mapping[str, str] | None = None,
    max_requests: int | None = None,
    max_seconds: float = 300.0,
    scenarios: Sequence[Scenario] = COMPARE,
    pooled: bool = True,
) -> list[Outcome]:
    """Run every scenario (plus the pooled bound when emulated) and return them in table order;
    real ``urls`` are called ``names`` (default host:port), as the user's own gateway calls them."""
    rows = list(scenarios)
    if configs is not None and pooled:
        rows.append(POOLED)
    total = len(workload.limited(max_requests).requests)
    outcomes = []
    run_salt = secrets.token_hex(4)
    for n, scenario in enumerate(rows):
        with progress(console, scenario.label, total) as advance:
            outcomes.append(
                await run_scenario(
                    scenario,
                    salted(workload, f"Row {n} of compare {run_salt}."),
                    configs=configs,
                    urls=urls,
                    names=names,
                    instance_key=instance_key,
                    model=model,
                    headers=headers,
                    max_requests=max_requests,
                    max_seconds=max_seconds,
                    on_sample=advance,
                )
            )
    return outcomes
