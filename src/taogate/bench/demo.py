"""``taogate demo``: the whole story on an emulated fleet, on free loopback ports, in about a minute.

1. Start 4 emulated vLLM instances (``i3`` 2.5x slower, prefix caching on) and a gateway (least_busy).
2. The article's 4.1 and 4.2 through the gateway with the OpenAI SDK, as the article runs them.
3. ``bench --compare`` (table 4.3): direct round robin, gateway round_robin and least_busy with prefix
   caching off, least_busy + affinity with caching on, and the pooled bound (caching off).
4. ``diagnose`` on the running fleet: the bisection and its verdict.
5. The plot, and how to point an OpenAI client at the gateway.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import time
from collections import Counter
from pathlib import Path

import openai
from rich.console import Console
from rich.table import Table

from taogate.bench.compare import run_compare
from taogate.bench.diagnose import diagnose
from taogate.bench.render import plot_runs, print_outcomes, render_diagnosis
from taogate.bench.report import IMBALANCE_RATIO, Distribution
from taogate.bench.scenarios import POOLED, Scenario, fleet_configs, gateway_settings
from taogate.bench.workloads import article, filler

__all__ = ["DEMO_SCENARIOS", "run_demo"]

SLOW_INDEX, SLOW_FACTOR = 3, 2.5
TAG = "prefill-bench"
DEMO_SCENARIOS = (
    Scenario("direct rr (no unified channel)", "direct", "round_robin", prefix_caching=False),
    Scenario("gw round_robin", "gateway", "round_robin", prefix_caching=False),
    Scenario("gw least_busy", "gateway", "least_busy", prefix_caching=False),
    Scenario(
        "gw least_busy+prefix caching",
        "gateway",
        "least_busy",
        prefix_affinity=True,
        prefix_caching=True,
    ),
    Scenario(POOLED.label, "pooled", prefix_caching=False),
)


async def _timed(client: openai.AsyncOpenAI, model: str, prompt: str) -> tuple[float, int, str | None, int]:
    start = time.perf_counter()
    raw = await client.completions.with_raw_response.create(
        model=model, prompt=prompt, max_tokens=16, temperature=0, extra_headers={"X-Request-Tag": TAG}
    )
    completion = raw.parse()
    prompt_tokens = completion.usage.prompt_tokens if completion.usage else 0
    return time.perf_counter() - start, raw.status_code, raw.headers.get("x-taogate-instance"), prompt_tokens


async def article_checks(console: Console, api_base: str, key: str, model: str, requests: int) -> None:
    """4.1 (one long prompt, elapsed ≈ TTFT) and 4.2 (``requests`` at 16 concurrent) via the SDK."""
    client = openai.AsyncOpenAI(base_url=api_base, api_key=key, max_retries=0, timeout=120)
    try:
        body = filler(4096)
        elapsed, status, inst, tokens = await _timed(client, model, body)
        console.print(
            f"[bold]4.1[/bold] one {tokens:,}-token prompt, max_tokens 16: {elapsed:.3f} s (≈ TTFT), "
            f"status {status}, served by {inst}"
        )
        slots = asyncio.Semaphore(16)

        async def one(i: int) -> tuple[float, int, str | None, int]:
            async with slots:
                return await _timed(client, model, f"{body} request number {i}")

        start = time.perf_counter()
        results = await asyncio.gather(*(one(i) for i in range(requests)))
        wall = time.perf_counter() - start
    finally:
        await client.close()
    lat = Distribution.of([r[0] for r in results])
    rule = "over" if lat.max_over_mean > IMBALANCE_RATIO else "within"
    per = Counter(r[2] for r in results)
    console.print(
        f"[bold]4.2[/bold] {requests} requests, 16 at a time: mean {lat.mean:.2f} s, max {lat.max:.2f} s, "
        f"min {lat.min:.2f} s, max/mean {lat.max_over_mean:.2f} ({rule} the article's "
        f"{IMBALANCE_RATIO:g}x rule), {sum(r[3] for r in results) / wall:,.0f} prompt tokens/s, "
        f"statuses {dict(Counter(r[1] for r in results))}"
    )
    console.print("    served per instance: " + ", ".join(f"{k} {v}" for k, v in sorted(per.items())))


def how_to(console: Console, url: str, key: str) -> None:
    table = Table(title="point an OpenAI client at the gateway", title_justify="left", show_header=False)
    table.add_row("base_url", f"{url}/v1   (or {url}/api/v1)")
    table.add_row("api_key", key)
    table.add_row(
        "python",
        f'from openai import OpenAI\nclient = OpenAI(base_url="{url}/v1", api_key="{key}")\n'
        'client.completions.create(model="emulated-model", prompt="hello", max_tokens=8)',
    )
    table.add_row(
        "curl",
        f"curl {url}/v1/completions -H 'Authorization: Bearer {key}' -H 'Content-Type: application/json' "
        '-d \'{"model": "emulated-model", "prompt": "hello", "max_tokens": 8}\'',
    )
    console.print(table)


async def run_demo(console: Console, *, plot: Path, requests: int = 64, hold: float = 0.0) -> int:
    """Run the demo; returns the process exit code (0 unless something could not run)."""
    from taogate.app import create_app
    from taogate.emulator.fleet import run_fleet
    from taogate.serving import serve_asgi

    configs = fleet_configs(4, {SLOW_INDEX: SLOW_FACTOR}, prefix_caching=True)
    model = configs[0].model
    key = os.environ.get("TAOTOKEN_API_KEY") or f"demo-{secrets.token_hex(8)}"
    scenario = Scenario("demo", "gateway", "least_busy", prefix_affinity=True)
    async with run_fleet(configs) as fleet:
        settings = gateway_settings(fleet.urls, scenario)
        async with serve_asgi(create_app(settings, environ={settings.gateway.api_key_env: key})) as served:
            console.rule("taogate demo")
            console.print(
                f"emulated fleet: {', '.join(f'i{n} {u}' for n, u in enumerate(fleet.urls))}; "
                f"i{SLOW_INDEX} is {SLOW_FACTOR}x slower; prefix caching on"
            )
            console.print(f"gateway: {served.url} (least_busy, prefix affinity, max_queue_per_instance 32)")
            console.rule("the article's checks (4.1, 4.2) through the gateway, OpenAI SDK")
            await article_checks(console, served.url + "/v1", key, model, requests)

            console.rule("bench --compare (the article's table 4.3, 48 requests of ~4,096 tokens each)")
            outcomes = await run_compare(
                article(48, 16), console=console, configs=configs, scenarios=DEMO_SCENARIOS, pooled=False
            )
            print_outcomes(console, outcomes, "article load, each row on a fresh emulated fleet")

            console.rule("diagnose (the article's bisection: max_queue_per_instance 32 vs 8)")
            result = await diagnose(fleet.urls, article(32, 16), model=model, strategy="least_busy")
            render_diagnosis(console, result)

            plot_runs(
                plot, [o.run for o in outcomes], title="taogate demo: the article's load, per configuration"
            )
            console.rule("plot and client")
            console.print(
                f"wrote {plot}: top, each configuration's latency CDF; below, one panel per configuration "
                "with every request as a bar from start to end on the row of the instance that served it"
            )
            how_to(console, served.url, key)
            if hold > 0:
                console.print(f"holding the fleet and gateway up for {hold:g} s (Ctrl-C to stop)")
                await asyncio.sleep(hold)
            else:
                console.print(
                    "(the gateway stops when the demo exits; `taogate demo --hold 600` keeps it up)"
                )
    return 0
