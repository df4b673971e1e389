"""``taogate diagnose`` and ``bench --compare`` against real vLLM: the slow card is named, a homogeneous
fleet with prefix caching on is not called sick, and compare's rows do not feed on each other's cache."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console

from taogate.bench.compare import run_compare
from taogate.bench.workloads import RequestSpec, Workload
from taogate.settings import instance_label
from tests.real.conftest import Pair, Say
from tests.real.gateway import engine_metrics, unique_prompt
from tests.real.server import SERVED_MODEL

TAOGATE = Path(sys.executable).with_name("taogate")
# Small enough for the tiny models' 4,096-token context and the tier's time budget.
DIAGNOSE = ["--model", SERVED_MODEL, "--requests", "16", "--concurrency", "4", "--prompt-tokens", "600"]
DIAGNOSE += ["--max-tokens", "8", "--max-seconds", "120"]


def diagnose(urls: list[str], tmp_path: Path) -> tuple[int, dict[str, Any]]:
    out = tmp_path / "diagnose.json"
    args = [str(TAOGATE), "diagnose", *DIAGNOSE, "--json", str(out)]
    for url in urls:
        args += ["--instance", url]
    done = subprocess.run(args, capture_output=True, text=True, timeout=300, check=False)
    assert out.exists(), done.stdout + done.stderr
    return done.returncode, json.loads(out.read_text())


def test_diagnose_names_the_slow_card(vllm_pair: Pair, tmp_path: Path, report: Say) -> None:
    code, result = diagnose([vllm_pair.fast.url, vllm_pair.slow.url], tmp_path)
    verdict = result["verdict"]
    report(f"diagnose on fast + slow: {verdict['headline']}")
    # Named as the gateway, status and the page name it: host:port, since no name is configured.
    slow = instance_label(vllm_pair.slow.url)
    assert (code, verdict["kind"], verdict["instance"]) == (2, "slow", slow), verdict


def test_diagnose_calls_a_homogeneous_cached_fleet_healthy(
    vllm_pair: Pair, tmp_path: Path, report: Say
) -> None:
    # The fast card twice: one engine, so two instances as alike as can be, prefix caching on.
    code, result = diagnose([vllm_pair.fast.url, vllm_pair.fast.url], tmp_path)
    verdict = result["verdict"]
    report(f"diagnose on fast + fast: {verdict['headline']}")
    assert (code, verdict["kind"]) == (0, "balanced"), verdict


async def test_compare_rows_do_not_reuse_each_others_cache(vllm_pair: Pair) -> None:
    # Prompts that share nothing with each other: within a row nothing can hit the cache, so any hit
    # a row sees comes from an earlier row's identical prompts.
    specs = tuple(RequestSpec(i, unique_prompt(300), 4, group="unique") for i in range(8))
    workload = Workload("unique", specs, 2)
    urls = [s.url for s in vllm_pair.servers]
    async with httpx.AsyncClient(timeout=30, trust_env=False) as http:
        before = [await engine_metrics(http, s) for s in vllm_pair.servers]
        outcomes = await run_compare(
            workload, console=Console(file=io.StringIO()), urls=urls, model=SERVED_MODEL
        )
        after = [await engine_metrics(http, s) for s in vllm_pair.servers]
    hits = sum((a.prefix_hits or 0) - (b.prefix_hits or 0) for a, b in zip(after, before, strict=True))
    queries = sum(
        (a.prefix_queries or 0) - (b.prefix_queries or 0) for a, b in zip(after, before, strict=True)
    )
    assert all(o.summary.ok == len(specs) for o in outcomes), [o.summary.errors for o in outcomes]
    assert hits / queries < 0.1, (hits, queries)
    # Each row reports the hit rate its instances' own counters saw.
    assert all(o.cache_hit_rate < 0.1 for o in outcomes), [o.cache_hit_rate for o in outcomes]
