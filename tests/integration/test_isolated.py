"""``bench.isolated``: the emulated fleet and the gateway each in a child process, as the dispatch
benchmark runs them; the children answer on 127.0.0.1 and are gone when the block exits."""

from __future__ import annotations

import contextlib
import os
from dataclasses import replace
from pathlib import Path

import httpx
import pytest

from taogate.bench import isolated
from taogate.bench.isolated import fleet_process, fleet_stats, gateway_process
from taogate.bench.scenarios import Scenario, gateway_settings, run_scenario
from taogate.bench.workloads import long_prompts
from taogate.emulator.config import EmulatorConfig

QUICK = EmulatorConfig(prefill_tokens_per_s=200_000, step_overhead=0.002, decode_tokens_per_s=50_000)


async def test_fleet_and_gateway_in_child_processes_serve_and_stop() -> None:
    configs = [replace(QUICK, seed=i) for i in range(2)]
    async with fleet_process(configs) as urls:
        assert len(urls) == 2 and all(u.startswith("http://127.0.0.1:") for u in urls)
        settings = gateway_settings(urls, Scenario("lb", "gateway"))
        async with gateway_process(settings, "the-key") as gw, httpx.AsyncClient(trust_env=False) as http:
            body = {"model": QUICK.model, "prompt": "hello", "max_tokens": 3}
            denied = await http.post(gw + "/v1/completions", json=body)
            assert denied.status_code == 401
            ok = await http.post(
                gw + "/v1/completions", json=body, headers={"authorization": "Bearer the-key"}
            )
            assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
        stats = await fleet_stats(urls)
        assert sum(s["completed"] for s in stats) >= 1  # ours, and the gateway's warm-up probes
    async with httpx.AsyncClient(trust_env=False) as http:
        for url in [*urls, gw]:
            try:
                await http.get(url + "/health", timeout=1)
            except httpx.ConnectError:
                continue
            raise AssertionError(f"{url} still answers after its process was stopped")


async def test_run_scenario_isolated_reports_the_emulators_books() -> None:
    configs = [replace(QUICK, seed=i, enable_prefix_caching=True) for i in range(2)]
    outcome = await run_scenario(
        Scenario("lb", "gateway"),
        long_prompts(6, 3, prompt_tokens=300, max_tokens=2),
        configs=configs,
        isolated=True,
    )
    assert outcome.summary.ok == 6
    assert sum(int(s["prompt_tokens"]) for s in outcome.emulator) >= 6 * 290
    assert outcome.admin is not None


async def test_a_child_that_dies_at_start_is_reported_with_its_exit_code() -> None:
    with pytest.raises(RuntimeError, match=r"isolated gateway exited with code 1 before it was ready"):
        async with gateway_process(object(), "the-key"):  # not Settings: the child fails at once
            pass


async def test_a_child_not_ready_in_time_is_reported_and_stopped(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(isolated, "START_TIMEOUT_S", 0.01)
    before = _children()
    with pytest.raises(RuntimeError, match=r"isolated fleet was not ready within 0.01 s"):
        async with fleet_process([QUICK]):
            pass
    assert _children() == before


def _children() -> set[int]:
    """This process's live child processes (from /proc)."""
    me = os.getpid()
    kids = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[1]) == me and fields[0] != "Z":
                kids.add(int(stat.parent.name))
    return kids
