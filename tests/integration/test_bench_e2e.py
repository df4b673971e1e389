"""``bench`` end to end on small emulated fleets: the runner, the duration cap, the CLI, JSON and plot."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import replace
from pathlib import Path

import typer
from typer.testing import CliRunner

from taogate.bench.cli import bench
from taogate.bench.runner import Target, run_load
from taogate.bench.workloads import Workload, long_prompts, shared_prefix
from taogate.emulator.config import EmulatorConfig
from taogate.emulator.fleet import run_fleet
from tests.conftest import KEY, Running

MODEL = "emulated-model"
QUICK = EmulatorConfig(prefill_tokens_per_s=200_000, step_overhead=0.002, decode_tokens_per_s=50_000)


def cli() -> typer.Typer:
    app = typer.Typer()
    app.command("bench")(bench)
    app.command("noop")(lambda: None)  # two commands: the command name stays in argv
    return app


async def test_runner_streams_and_records_usage_instance_and_ttft() -> None:
    async with run_fleet([replace(QUICK, seed=i) for i in range(2)]) as fleet:
        targets = [Target(u + "/v1", "", f"i{n}") for n, u in enumerate(fleet.urls)]
        run = await run_load(targets, long_prompts(8, 4, prompt_tokens=300, max_tokens=5), MODEL)
    assert len(run.samples) == 8 and all(s.ok for s in run.samples)
    assert sorted(s.index for s in run.samples) == list(range(8))
    assert {s.instance for s in run.samples} == {"i0", "i1"}
    for s in run.samples:
        assert s.ttft is not None and 0 < s.ttft <= s.latency
        assert s.completion_tokens == 5 and 290 <= s.prompt_tokens <= 320


async def test_chat_requests_and_gateway_instance_header(gw: Running) -> None:
    run = await run_load([Target(gw.api_base, KEY)], shared_prefix(6, 3, system_tokens=100), MODEL)
    assert all(s.ok for s in run.samples), [s.error for s in run.samples]
    assert {s.instance for s in run.samples} <= {"i0", "i1"} and all(s.instance for s in run.samples)


async def test_duration_cap_cancels_what_hangs() -> None:
    hanging = replace(QUICK, faults=replace(QUICK.faults, hang=True))
    async with run_fleet([hanging]) as fleet:
        t = time.perf_counter()
        run = await run_load(
            [Target(fleet.urls[0] + "/v1", "", "i0")], long_prompts(5, 2, 50), MODEL, max_seconds=0.5
        )
        elapsed = time.perf_counter() - t
    assert elapsed < 3
    assert run.stopped_early
    assert len(run.samples) == 2  # only the two in flight were launched; both cancelled
    assert all(s.error == "cancelled at the duration cap" and s.status == 0 for s in run.samples)


async def test_errors_are_recorded_with_their_status(gw: Running) -> None:
    wl = Workload("bad", long_prompts(2, 2, 20).requests, 2)
    run = await run_load([Target(gw.api_base, "wrong-key")], wl, MODEL)
    assert [s.status for s in run.samples] == [401, 401]
    assert all(s.error for s in run.samples)


def test_bench_cli_compare_emulated_writes_json_and_plot(tmp_path: Path) -> None:
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    args = ["bench", "--emulate", "--compare", "--instances", "2", "--slow", "1=2", "--no-prefix-caching"]
    args += ["--requests", "6", "--concurrency", "3", "--prompt-tokens", "300", "--max-tokens", "4"]
    args += ["--json", str(out), "--plot", str(png)]
    result = CliRunner().invoke(cli(), args)
    assert result.exit_code == 0, result.output
    for label in ("direct rr", "gw round_robin", "gw least_busy", "gw least_busy+affinity", "pooled bound"):
        assert label in result.output
    data = json.loads(out.read_text())
    assert len(data["runs"]) == 5
    assert all(r["summary"]["ok"] == 6 for r in data["runs"])
    assert data["runs"][-1]["summary"]["per_instance"]["pooled"]["count"] == 6
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


async def test_bench_cli_against_a_running_gateway_with_a_profile(gw: Running, tmp_path: Path) -> None:
    profile = tmp_path / "settings.json"
    profile.write_text(
        json.dumps(
            {
                "taotoken": {
                    "base_url": gw.url + "/api",
                    "api_key": KEY,
                    "default_model": MODEL,
                    "headers": {"X-Request-Tag": "prefill-bench"},
                }
            }
        )
    )
    args = ["bench", "--settings", str(profile), "--workload", "single", "--prompt-tokens", "200"]
    result = await asyncio.to_thread(CliRunner().invoke, cli(), args)
    assert result.exit_code == 0, result.output
    assert "your gateway" in result.output and "1/1" in result.output
    tags = sum(inst.stats()["tags"].get("prefill-bench", 0) for inst in gw.fleet.instances)
    assert tags == 1  # the profile's X-Request-Tag reached vLLM
