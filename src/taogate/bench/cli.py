"""The ``bench``, ``diagnose`` and ``demo`` commands (registered by ``taogate.cli``).

They only map flags onto the library: ``bench.endpoint`` resolves where the load goes from the files
``serve`` reads, and flags override it. ``--emulate`` starts an emulated fleet in-process instead of
talking to a real one. Every run is capped by ``--max-requests`` and ``--max-seconds``.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Annotated, Any

import httpx
import typer
from rich.console import Console
from rich.markup import escape

from taogate.bench import workloads
from taogate.bench.compare import run_compare, run_target
from taogate.bench.diagnose import Diagnosis
from taogate.bench.diagnose import diagnose as run_diagnosis
from taogate.bench.endpoint import Endpoint, fail, resolve_endpoint
from taogate.bench.notes import held_logs
from taogate.bench.options import (
    BaseUrlOpt,
    CacheOpt,
    ConcOpt,
    ConfigOpt,
    EmulateOpt,
    FileOpt,
    InstancesOpt,
    InstanceUrlOpt,
    JsonOpt,
    KeyOpt,
    MaxReqOpt,
    MaxSecOpt,
    MaxTokOpt,
    ModelOpt,
    PlotOpt,
    PromptOpt,
    RateOpt,
    RequestsOpt,
    SettingsOpt,
    SlowOpt,
    StrategyOpt,
    WorkloadOpt,
)
from taogate.bench.render import (
    instance_table,
    make_console,
    plot_runs,
    print_outcomes,
    render_diagnosis,
    run_payload,
    write_json,
)
from taogate.bench.runner import Target
from taogate.bench.scenarios import Outcome, Scenario, fleet_capacity, fleet_configs
from taogate.dispatch.types import STRATEGIES
from taogate.emulator.config import EmulatorConfig
from taogate.settings import DispatchSettings

__all__ = ["bench", "demo", "diagnose"]

WORKLOADS = ("long-prompts", "single", "mixed", "shared-prefix", "file")
#: Mixed traffic is offered at this fraction of the emulated fleet's prefill capacity by default.
MIXED_LOAD = 0.7


def build_workload(
    kind: str,
    *,
    requests: int | None,
    concurrency: int,
    prompt_tokens: int,
    max_tokens: int,
    rate: float | None,
    file: Path | None,
    capacity: float | None = None,
) -> workloads.Workload:
    """The workload named by ``--workload`` with the size flags applied."""
    if kind == "long-prompts":
        return workloads.long_prompts(requests or 64, concurrency, prompt_tokens, max_tokens)
    if kind == "single":
        return workloads.single(prompt_tokens, max_tokens)
    if kind == "mixed":
        if rate is None:
            rate = MIXED_LOAD * capacity / workloads.mixed_mean_tokens() if capacity else 4.0
        return workloads.mixed(requests or 200, rate, max_tokens=max_tokens)
    if kind == "shared-prefix":
        return workloads.shared_prefix(
            requests or 128, concurrency, system_tokens=prompt_tokens, max_tokens=max_tokens
        )
    if kind == "file":
        if file is None:
            raise fail("--workload file needs --file PATH (JSONL: one prompt per line)")
        try:
            return workloads.from_file(file, concurrency, max_tokens).limited(requests)
        except (OSError, ValueError) as exc:
            raise fail(str(exc)) from None
    raise fail(f"unknown workload {kind!r}; choose one of: {', '.join(WORKLOADS)}")


def emulated_configs(instances: int, slow: list[str] | None, prefix_caching: bool) -> list[EmulatorConfig]:
    from taogate.emulator.cli import parse_slow

    return fleet_configs(instances, parse_slow(slow or [], instances), prefix_caching=prefix_caching)


def _outputs(console: Console, outcomes: list[Outcome], json_out: Path | None, plot: Path | None) -> None:
    if json_out is not None:
        payload = {"runs": [run_payload(o.run, o.summary, admin=o.admin) for o in outcomes]}
        write_json(json_out, payload)
        console.print(f"wrote {json_out}")
    if plot is not None:
        plot_runs(plot, [o.run for o in outcomes])
        console.print(f"wrote {plot}")


async def _bench(
    console: Console,
    ep: Endpoint,
    wl: workloads.Workload,
    *,
    compare: bool,
    configs: list[EmulatorConfig] | None,
    scenario: Scenario,
    max_requests: int,
    max_seconds: float,
) -> list[Outcome]:
    caps: dict[str, Any] = {"max_requests": max_requests, "max_seconds": max_seconds}
    if configs is not None:
        from taogate.bench.scenarios import run_scenario

        if compare:
            return await run_compare(wl, console=console, configs=configs, **caps)
        return [await run_scenario(scenario, wl, configs=configs, **caps)]
    outcomes = []
    if ep.api_base is not None:
        if ep.key_error is not None:
            raise fail(ep.key_error)
        target = Target(ep.api_base, ep.key)
        label = f"your gateway ({ep.base_url})"
        outcomes.append(
            await run_target(
                target,
                wl,
                model=ep.model,
                label=label,
                console=console,
                headers=ep.headers,
                http_timeout=ep.timeout,
                **caps,
            )
        )
    if compare:
        if not ep.instances:
            raise fail(
                "--compare needs the instances: --instance URL, or config.toml's [[instances]] or "
                "settings.json's vllm.instances"
            )
        outcomes += await run_compare(
            wl,
            console=console,
            urls=ep.instances,
            names=ep.names,
            instance_key=ep.key,
            model=ep.model,
            headers=ep.headers,
            **caps,
        )
    if not outcomes:
        raise fail("nothing to run: give --base-url or --settings, or use --emulate")
    return outcomes


def bench(
    *,
    settings: SettingsOpt = None,
    config: ConfigOpt = None,
    base_url: BaseUrlOpt = None,
    key: KeyOpt = None,
    model: ModelOpt = None,
    workload: WorkloadOpt = "long-prompts",
    requests: RequestsOpt = None,
    concurrency: ConcOpt = 16,
    prompt_tokens: PromptOpt = 4096,
    max_tokens: MaxTokOpt = 16,
    rate: RateOpt = None,
    file: FileOpt = None,
    json_out: JsonOpt = None,
    plot: PlotOpt = None,
    compare: Annotated[
        bool, typer.Option("--compare", help="Every configuration side by side on the same workload.")
    ] = False,
    emulate: EmulateOpt = False,
    instances: InstancesOpt = 4,
    slow: SlowOpt = None,
    prefix_caching: CacheOpt = True,
    instance: InstanceUrlOpt = None,
    strategy: StrategyOpt = "least_busy",
    max_requests: MaxReqOpt = 1000,
    max_seconds: MaxSecOpt = 600.0,
) -> None:
    """Load the gateway (streaming, so TTFT is real) and report TTFT, latency, throughput and each
    instance's share.

    --compare runs, side by side on the same load: round robin straight to the instances, then
    in-process gateways with each strategy, and on an emulated fleet the pooled bound (one emulated
    instance with the whole fleet's summed speed, batch slots and cache, which no dispatcher of
    separate instances should beat). With --settings or ./settings.json, your own gateway is the
    first row."""
    console = make_console()
    ep = resolve_endpoint(settings, base_url, key, model, instance, emulate=emulate, config=config)
    configs = emulated_configs(instances, slow, prefix_caching) if emulate else None
    wl = build_workload(
        workload,
        requests=requests,
        concurrency=concurrency,
        prompt_tokens=prompt_tokens,
        max_tokens=max_tokens,
        rate=rate,
        file=file,
        capacity=fleet_capacity(configs) if configs else None,
    )
    affinity = strategy == "least_busy"  # the default gateway's dispatch, named as compare names it
    label = f"gateway {strategy}" + ("+affinity" if affinity else "")
    scenario = Scenario(label, "gateway", strategy, prefix_affinity=affinity)
    with held_logs() as held:
        outcomes = asyncio.run(
            _bench(
                console,
                ep,
                wl,
                compare=compare,
                configs=configs,
                scenario=scenario,
                max_requests=max_requests,
                max_seconds=max_seconds,
            )
        )
    print_outcomes(
        console, outcomes, f"taogate bench: {wl.name}, {len(wl.limited(max_requests).requests)} requests"
    )
    if len(outcomes) == 1:
        console.print(instance_table(outcomes[0].summary, outcomes[0].admin))
    held.flush_to(console)
    _outputs(console, outcomes, json_out, plot)
    if all(o.summary.ok == 0 for o in outcomes):
        raise typer.Exit(3)


async def _diagnose_emulated(
    configs: list[EmulatorConfig], wl: workloads.Workload, **kwargs: Any
) -> Diagnosis:
    from taogate.emulator.fleet import run_fleet

    async with run_fleet(configs) as fleet:
        # Numbered like --slow INDEX=FACTOR: the short form the user chose for an emulated fleet.
        names = [f"i{n}" for n in range(len(fleet.urls))]
        return await run_diagnosis(fleet.urls, wl, model=configs[0].model, names=names, **kwargs)


def diagnose(
    *,
    settings: SettingsOpt = None,
    config: ConfigOpt = None,
    key: KeyOpt = None,
    model: ModelOpt = None,
    workload: WorkloadOpt = "long-prompts",
    requests: RequestsOpt = None,
    concurrency: ConcOpt = 16,
    prompt_tokens: PromptOpt = 4096,
    max_tokens: MaxTokOpt = 16,
    rate: RateOpt = None,
    file: FileOpt = None,
    cap: Annotated[
        int,
        typer.Option(
            "--lowered-cap",
            "--cap",
            min=1,
            help="Run B's max_queue_per_instance, the lowered one (the article's 8): if max latency drops "
            "with it, the cause is dispatch.",
        ),
    ] = 8,
    queue_cap: Annotated[
        int | None,
        typer.Option(
            "--configured-cap",
            "--queue-cap",
            min=1,
            help=escape(
                "Run A's max_queue_per_instance: the cap your gateway runs with. Default: config.toml's "
                "[dispatch] max_queue_per_instance, else 32."
            ),
        ),
    ] = None,
    strategy: Annotated[
        str | None,
        typer.Option(
            "--strategy",
            help=escape(
                "The strategy of diagnose's own gateway in both runs, as yours runs "
                f"({', '.join(STRATEGIES)}). Default: config.toml's [dispatch] strategy, else least_busy."
            ),
        ),
    ] = None,
    probe: Annotated[
        bool,
        typer.Option(
            "--probe/--no-probe",
            help="First send each instance a long prompt alone, 5 times, for its own speed.",
        ),
    ] = True,
    json_out: JsonOpt = None,
    plot: PlotOpt = None,
    emulate: EmulateOpt = False,
    instances: InstancesOpt = 4,
    slow: SlowOpt = None,
    prefix_caching: CacheOpt = True,
    instance: InstanceUrlOpt = None,
    max_requests: MaxReqOpt = 1000,
    max_seconds: MaxSecOpt = 300.0,
) -> None:
    """Is uneven latency dispatch, one slow instance, or nothing? The queue-cap bisection.

    diagnose starts a gateway of its own, in this process, in front of your instances; it does not
    use or change a gateway you have running. It probes each instance alone, then runs the same load
    twice through its gateway: at --configured-cap, then with max_queue_per_instance lowered to
    --lowered-cap. If max latency drops, requests piled up in one queue: the cause is dispatch. If
    not, an instance whose own prefill speed is low is named. Every prompt gets a prefix of its own,
    so prefix-cache hits do not pass for speed. Exit 0 balanced, 1 dispatch, 2 slow instance (or
    inside vLLM), 3 could not run."""
    console = make_console()
    ep = resolve_endpoint(settings, None, key, model, instance, emulate=emulate, config=config)
    configs = emulated_configs(instances, slow, prefix_caching) if emulate else None
    wl = build_workload(
        workload,
        requests=requests,
        concurrency=concurrency,
        prompt_tokens=prompt_tokens,
        max_tokens=max_tokens,
        rate=rate,
        file=file,
        capacity=fleet_capacity(configs) if configs else None,
    ).limited(max_requests)
    configured = ep.dispatch or DispatchSettings()  # as serve would run: config.toml's, else defaults
    kwargs: dict[str, Any] = {
        "strategy": strategy or configured.strategy,
        "cap": queue_cap or configured.max_queue_per_instance,
        "low_cap": cap,
        "probe": probe,
        "probe_tokens": prompt_tokens,
        "max_seconds": max_seconds,
    }
    with held_logs() as held:
        try:
            if configs is not None:
                result = asyncio.run(_diagnose_emulated(configs, wl, **kwargs))
            elif ep.instances:
                result = asyncio.run(
                    run_diagnosis(ep.instances, wl, model=ep.model, key=ep.key, names=ep.names, **kwargs)
                )
            else:
                raise fail(
                    "diagnose needs the instances: --instance URL, or a config.toml with [[instances]] or a "
                    "settings.json with vllm.instances here (or named by --config / --settings), or --emulate"
                )
        except (OSError, httpx.HTTPError) as exc:
            raise fail(f"could not run: {exc}") from None
    render_diagnosis(console, result)
    held.flush_to(console)
    if json_out is not None:
        write_json(
            json_out,
            {
                "verdict": {
                    "kind": result.verdict.kind,
                    "instance": result.verdict.instance,
                    "headline": result.verdict.headline,
                    "evidence": list(result.verdict.evidence),
                },
                "runs": [
                    run_payload(r, s, admin=a)
                    for r, s, a in zip(
                        result.runs,
                        (result.evidence.configured, result.evidence.lowered),
                        result.admin,
                        strict=True,
                    )
                ],
            },
        )
    if plot is not None:
        plot_runs(plot, result.runs, title="taogate diagnose")
    raise typer.Exit(result.verdict.exit_code)


def demo(
    *,
    plot: Annotated[Path, typer.Option("--plot", help="Where to write the PNG plot.")] = Path(
        "taogate-demo.png"
    ),
    requests: Annotated[int, typer.Option("--requests", help="Long prompts in the 16-at-a-time check.")] = 64,
    hold: Annotated[
        float, typer.Option("--hold", help="Keep the fleet and gateway up this many seconds.")
    ] = 0.0,
) -> None:
    """Emulated fleet (4 instances, one 2.5x slow) + gateway: one long prompt, 64 long prompts 16 at
    a time, bench --compare, diagnose, plot."""
    from taogate.bench.demo import run_demo

    raise typer.Exit(asyncio.run(run_demo(make_console(), plot=plot, requests=requests, hold=hold)))
