"""``diagnose`` end to end on small emulated fleets: slow instance, dispatch pile-up, and nothing wrong."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from taogate.bench.cli import diagnose as diagnose_command
from taogate.bench.diagnose import Diagnosis, diagnose
from taogate.bench.scenarios import fleet_configs
from taogate.bench.workloads import RequestSpec, Workload, filler, long_prompts
from taogate.emulator.config import EmulatorConfig
from taogate.emulator.fleet import run_fleet

# 4x the default engine speed, so the article's shapes play out in a fraction of the time.
BASE = EmulatorConfig(prefill_tokens_per_s=80_000, step_overhead=0.003, decode_tokens_per_s=12_800)


async def run(
    slow: dict[int, float], strategy: str, workload: Workload, *, caching: bool = False, **kw: Any
) -> Diagnosis:
    async with run_fleet(fleet_configs(4, slow, base=BASE, prefix_caching=caching)) as fleet:
        names = [f"i{n}" for n in range(len(fleet.urls))]
        return await diagnose(
            fleet.urls, workload, model=BASE.model, strategy=strategy, probe_tokens=2048, names=names, **kw
        )


def long_every_fourth(n: int = 80, rate: float = 100.0, long: int = 8000, short: int = 100) -> Workload:
    """Open-loop arrivals in order; every 4th prompt is long, so round robin over 4 piles them on i0."""
    specs = []
    for i in range(n):
        size = long if i % 4 == 0 else short
        specs.append(RequestSpec(i, f"R{i}. {filler(size)}", 8, at=i / rate, approx_tokens=size))
    return Workload("long-every-4th", tuple(specs), 256)


async def test_names_the_slow_instance() -> None:
    result = await run({2: 4.0}, "least_busy", long_prompts(16, 8, prompt_tokens=2048))
    v = result.verdict
    assert v.kind == "slow" and v.instance == "i2" and v.exit_code == 2, v
    assert result.evidence.probe_speeds["i2"] < 0.4 * result.evidence.probe_speeds["i0"]


async def test_round_robin_piling_long_prompts_is_dispatch() -> None:
    result = await run({}, "round_robin", long_every_fourth(), low_cap=4, probe=False)
    v = result.verdict
    assert v.kind == "dispatch" and v.exit_code == 1, v
    a, b = result.evidence.configured, result.evidence.lowered
    assert a.per_instance["i0"].prompt_tokens > 3 * a.per_instance["i1"].prompt_tokens  # the pile
    assert b.latency.max < a.latency.max / 1.5


async def test_homogeneous_least_busy_fleet_is_balanced() -> None:
    result = await run({}, "least_busy", long_prompts(16, 8, prompt_tokens=2048))
    assert result.verdict.kind == "balanced" and result.verdict.exit_code == 0, result.verdict


async def test_a_homogeneous_cached_fleet_is_balanced() -> None:
    # Prompts sharing one long body, caching on: hits would make some requests fast and the rest
    # slow whatever the dispatch. Diagnose gives each request a prefix of its own, and says so.
    result = await run({}, "least_busy", long_prompts(16, 8, prompt_tokens=2048), caching=True)
    assert result.verdict.kind == "balanced", result.verdict
    hits = result.evidence.instance_hits
    assert set(hits) == {"i0", "i1", "i2", "i3"} and max(hits.values()) < 0.1, hits
    assert any("hit rate per instance" in line for line in result.verdict.evidence)


async def test_probes_are_repeated_and_their_spread_kept() -> None:
    result = await run({1: 3.0}, "least_busy", long_prompts(8, 4, prompt_tokens=1024))
    spread = result.evidence.probe_range
    assert set(spread) == {"i0", "i1", "i2", "i3"}
    low, high = spread["i1"]
    assert low <= result.evidence.probe_speeds["i1"] <= high < 0.5 * result.evidence.probe_speeds["i0"]
    assert result.verdict.instance == "i1"


def test_cli_exit_code_reflects_the_verdict(tmp_path: Path) -> None:
    app = typer.Typer()
    app.command("diagnose")(diagnose_command)
    app.command("noop")(lambda: None)
    out = tmp_path / "d.json"
    args = ["diagnose", "--emulate", "--instances", "2", "--slow", "1=5", "--requests", "6"]
    args += ["--concurrency", "3", "--prompt-tokens", "600", "--max-tokens", "2", "--json", str(out)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, result.output
    assert "instance i1 is slow" in result.output
    assert '"kind": "slow"' in out.read_text()


def test_cli_without_instances_cannot_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # no ./config.toml or ./settings.json to take the instances from
    app = typer.Typer()
    app.command("diagnose")(diagnose_command)
    app.command("noop")(lambda: None)
    result = CliRunner().invoke(app, ["diagnose", "--requests", "1"])
    assert result.exit_code == 3
