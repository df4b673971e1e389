"""``taogate demo``: the whole story on an emulated fleet, on free loopback ports, in about a minute.

1. Start 4 emulated vLLM instances (``i3`` 2.5x slower, prefix caching on) and a gateway (least_busy).
2. Two checks through the gateway with the OpenAI SDK: one long prompt (elapsed ≈ TTFT), then 64
   long prompts 16 at a time (the max/mean ≤ 2 rule; when it fires, why: these prompts share their
   long body, so cache hits against misses).
3. ``bench --compare``, side by side: direct round robin, gateway round_robin and least_busy with
   prefix caching off and the pooled bound with its cache off; least_busy + affinity with caching
   on and the pooled bound with its cache on.
4. ``diagnose`` on the running fleet: the queue-cap bisection and its verdict.
5. The plot, and how to point an OpenAI client at the gateway; the fleet page's address is printed
   at the start, and ``--hold`` keeps the gateway up after the end to look at it.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import statistics
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import openai
from rich.console import Console
from rich.table import Table

from taogate.bench.compare import run_compare
from taogate.bench.diagnose import diagnose
from taogate.bench.notes import held_logs
from taogate.bench.render import plot_runs, print_outcomes, render_diagnosis
from taogate.bench.report import IMBALANCE_RATIO, Distribution
from taogate.bench.scenarios import POOLED, Scenario, fleet_configs, gateway_settings
from taogate.bench.workloads import filler, long_prompts

__all__ = ["DEMO_SCENARIOS", "run_demo"]

SLOW_INDEX, SLOW_FACTOR = 3, 2.5
TAG = "prefill-bench"
DEMO_SCENARIOS = (
    Scenario("direct rr (no unified channel)", "direct", "round_robin", prefix_caching=False),
    Scenario("gw round_robin", "gateway", "round_robin", prefix_caching=False),
    Scenario("gw least_busy", "gateway", "least_busy", prefix_caching=False),
    Scenario(f"{POOLED.label}, caching off", "pooled", prefix_caching=False),
    Scenario(
        "gw least_busy+prefix caching",
        "gateway",
        "least_busy",
        prefix_affinity=True,
        prefix_caching=True,
    ),
    # The bound holds the fleet's summed cache too: the row with caching on is compared with it.
    Scenario(f"{POOLED.label}, caching on", "pooled", prefix_caching=True),
)


@dataclass(frozen=True, slots=True)
class Answer:
    seconds: float
    status: int
    instance: str | None
    prompt_tokens: int


async def _timed(client: openai.AsyncOpenAI, model: str, prompt: str) -> Answer:
    start = time.perf_counter()
    raw = await client.completions.with_raw_response.create(
        model=model, prompt=prompt, max_tokens=16, temperature=0, extra_headers={"X-Request-Tag": TAG}
    )
    usage = raw.parse().usage
    return Answer(
        time.perf_counter() - start,
        raw.status_code,
        raw.headers.get("x-taogate-instance"),
        usage.prompt_tokens if usage else 0,
    )


def rule_line(answers: Sequence[Answer], slow_card: str, burst: int) -> str:
    """The article's max/mean <= 2 rule on these answers (in request order) and, when it fires, why.
    Measured on this demo: the slow card this demo injects gets few requests, but each is several
    times slower, which alone puts max/mean over 2; the first ``burst``, sent at once, also wait
    while each instance first prefills the prompts' shared body (prefix-cache warm-up)."""
    mm = Distribution.of([a.seconds for a in answers]).max_over_mean
    head = (
        f"max/mean {mm:.2f}, {'within' if mm <= IMBALANCE_RATIO else 'over'} the article's max/mean ≤ 2 rule"
    )
    on = [a.seconds for a in answers if a.instance == slow_card]
    rest = [a.seconds for a in answers if a.instance != slow_card]
    if mm <= IMBALANCE_RATIO or not on or not rest:
        return head
    without = Distribution.of(rest).max_over_mean
    line = (
        f"{head}, as it should be on this fleet: {slow_card} is the {SLOW_FACTOR}x slow card the demo "
        f"injects. Dispatch gave it {len(on)} of {len(answers)} requests, but each took mean "
        f"{statistics.fmean(on):.2f} s against {statistics.fmean(rest):.2f} s on the others (max/mean "
        f"{without:.2f} without them)"
    )
    later = [a.seconds for a in answers[burst:] if a.instance != slow_card]
    if without > IMBALANCE_RATIO and later:
        line += (
            f"; the first {burst}, sent at once, also waited while each instance first prefilled the "
            f"prompts' shared body (after them, max/mean {Distribution.of(later).max_over_mean:.2f})"
        )
    return (
        line
        + ". The rule sees uneven latency, not its cause: diagnose, below, tells dispatch from a slow card"
    )


async def sdk_checks(console: Console, api_base: str, key: str, model: str, requests: int) -> None:
    """One long prompt (elapsed ≈ TTFT), then ``requests`` long prompts 16 at a time, via the SDK."""
    client = openai.AsyncOpenAI(base_url=api_base, api_key=key, max_retries=0, timeout=120)
    try:
        body = filler(4096)
        first = await _timed(client, model, body)
        console.print(
            f"[bold]one long prompt[/bold] of {first.prompt_tokens:,} tokens, max_tokens 16: "
            f"{first.seconds:.3f} s (≈ TTFT), status {first.status}, served by {first.instance}"
        )
        slots = asyncio.Semaphore(16)

        async def one(i: int) -> Answer:
            async with slots:
                return await _timed(client, model, f"{body} request number {i}")

        start = time.perf_counter()
        answers = list(await asyncio.gather(*(one(i) for i in range(requests))))
        wall = time.perf_counter() - start
    finally:
        await client.close()
    lat = Distribution.of([a.seconds for a in answers])
    per = Counter(a.instance for a in answers)
    console.print(
        f"[bold]{requests} long prompts, 16 at a time[/bold]: mean {lat.mean:.2f} s, max {lat.max:.2f} s, "
        f"min {lat.min:.2f} s, {sum(a.prompt_tokens for a in answers) / wall:,.0f} prompt tokens/s, "
        f"statuses {dict(Counter(a.status for a in answers))}"
    )
    console.print("    " + rule_line(answers, f"i{SLOW_INDEX}", 16), markup=False)
    console.print("    served per instance: " + ", ".join(f"{k} {v}" for k, v in sorted(per.items())))


def how_to(console: Console, url: str, key: str) -> None:
    table = Table(title="point an OpenAI client at the gateway", title_justify="left", show_header=False)
    table.add_row("base_url", f"{url}/v1   (or {url}/api/v1)")
    table.add_row("api_key", key)
    table.add_row("fleet page", f"{url}/dashboard   (the same key; or taogate status --watch)")
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
    with held_logs() as held:
        async with run_fleet(configs) as fleet:
            settings = gateway_settings(fleet.urls, scenario)
            async with serve_asgi(
                create_app(settings, environ={settings.gateway.api_key_env: key})
            ) as served:
                console.rule("taogate demo")
                console.print(
                    f"emulated fleet: {', '.join(f'i{n} {u}' for n, u in enumerate(fleet.urls))}; "
                    f"i{SLOW_INDEX} is {SLOW_FACTOR}x slower; prefix caching on"
                )
                console.print(
                    f"gateway: {served.url} (least_busy, prefix affinity, max_queue_per_instance 32)"
                )
                console.print(
                    f"fleet page: {served.url}/dashboard (admin key: {key}); in a terminal: "
                    f"taogate status --watch --url {served.url} --key {key}"
                )
                console.rule(
                    "one long prompt, then long prompts 16 at a time, through the gateway (OpenAI SDK)"
                )
                await sdk_checks(console, served.url + "/v1", key, model, requests)

                console.rule("bench --compare: every configuration side by side, 48 prompts of ~4,096 tokens")
                outcomes = await run_compare(
                    long_prompts(48, 16),
                    console=console,
                    configs=configs,
                    scenarios=DEMO_SCENARIOS,
                    pooled=False,
                )
                print_outcomes(
                    console, outcomes, "long prompts, 16 at a time, each row on a fresh emulated fleet"
                )
                held.flush_to(console)

                console.rule(
                    "diagnose: the same load at max_queue_per_instance 32 and 8 (dispatch or slow card?)"
                )
                names = [f"i{n}" for n in range(len(fleet.urls))]  # as the demo's gateway calls them
                result = await diagnose(
                    fleet.urls, long_prompts(32, 16), model=model, strategy="least_busy", names=names
                )
                render_diagnosis(console, result)
                held.flush_to(console)

                plot_runs(
                    plot, [o.run for o in outcomes], title="taogate demo: long prompts, per configuration"
                )
                console.rule("plot and client")
                console.print(
                    f"wrote {plot}: top, each configuration's latency CDF; below, one panel per "
                    "configuration with every request as a bar from start to end on the row of the "
                    "instance that served it"
                )
                how_to(console, served.url, key)
                if hold > 0:
                    console.print(
                        f"holding the fleet and gateway up for {hold:g} s (Ctrl-C to stop); "
                        f"the fleet page: {served.url}/dashboard"
                    )
                    await asyncio.sleep(hold)
                else:
                    console.print(
                        "(the gateway stops when the demo exits; `taogate demo --hold 600` keeps it up)"
                    )
    return 0
