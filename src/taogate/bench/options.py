"""The command-line options ``bench``, ``diagnose`` and ``demo`` share, each with its help text."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from taogate.dispatch.types import STRATEGIES

__all__ = [
    "BaseUrlOpt",
    "CacheOpt",
    "ConcOpt",
    "ConfigOpt",
    "EmulateOpt",
    "FileOpt",
    "InstanceUrlOpt",
    "InstancesOpt",
    "JsonOpt",
    "KeyOpt",
    "MaxReqOpt",
    "MaxSecOpt",
    "MaxTokOpt",
    "ModelOpt",
    "PlotOpt",
    "PromptOpt",
    "RateOpt",
    "RequestsOpt",
    "SettingsOpt",
    "SlowOpt",
    "StrategyOpt",
    "WorkloadOpt",
]

SettingsOpt = Annotated[
    Path | None,
    typer.Option(
        "--settings",
        help="settings.json: the gateway's URL, key and model (taotoken), the instance URLs "
        "(vllm.instances). Default: ./settings.json when it exists, as serve reads it.",
    ),
]
ConfigOpt = Annotated[
    Path | None,
    typer.Option(
        "--config",
        "-c",
        help=escape(
            "config.toml whose [[instances]] (their names too) are the fleet, as serve reads it. "
            "Default: ./config.toml when it exists."
        ),
    ),
]
BaseUrlOpt = Annotated[str | None, typer.Option("--base-url", help="Gateway base URL (overrides profile).")]
KeyOpt = Annotated[str | None, typer.Option("--key", help="API key (default: profile, $TAOTOKEN_API_KEY).")]
ModelOpt = Annotated[str | None, typer.Option("--model", help="Model name (default: profile).")]
WorkloadOpt = Annotated[str, typer.Option("--workload", help="long-prompts|single|mixed|shared-prefix|file.")]
RequestsOpt = Annotated[
    int | None, typer.Option("--requests", min=1, help="Requests per run (workload default).")
]
ConcOpt = Annotated[
    int,
    typer.Option(
        "--concurrency",
        min=1,
        help="Requests in flight at once (long-prompts, shared-prefix, file; mixed arrives at --rate, "
        "single is one request).",
    ),
]
PromptOpt = Annotated[int, typer.Option("--prompt-tokens", min=1, help="Approximate prompt size in tokens.")]
MaxTokOpt = Annotated[int, typer.Option("--max-tokens", min=1, help="max_tokens per request.")]


def _positive_rate(value: float | None) -> float | None:
    if value is not None and not value > 0:
        raise typer.BadParameter("arrivals per second must be above 0")
    return value


RateOpt = Annotated[
    float | None,
    typer.Option("--rate", callback=_positive_rate, help="mixed: Poisson arrivals per second."),
]
FileOpt = Annotated[Path | None, typer.Option("--file", help="JSONL prompts for --workload file.")]
JsonOpt = Annotated[Path | None, typer.Option("--json", help="Write results (summaries, samples) here.")]
PlotOpt = Annotated[Path | None, typer.Option("--plot", help="Write a PNG plot here.")]
EmulateOpt = Annotated[
    bool, typer.Option("--emulate", help="Start an emulated fleet and gateway in-process.")
]
InstancesOpt = Annotated[int, typer.Option("--instances", min=1, help="--emulate: fleet size.")]
SlowOpt = Annotated[list[str] | None, typer.Option("--slow", help="--emulate: INDEX=FACTOR slow instance.")]
CacheOpt = Annotated[
    bool,
    typer.Option(
        "--prefix-caching/--no-prefix-caching",
        help="--emulate: the emulated instances' prefix caching (on by default, as recommended for vLLM).",
    ),
]
InstanceUrlOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--instance",
        help=escape(
            "A vLLM base URL (repeat). Default: the instances serve would use: config.toml's "
            "[[instances]], else settings.json's vllm.instances. Each is called by its configured "
            "name, else host:port."
        ),
    ),
]
MaxReqOpt = Annotated[int, typer.Option("--max-requests", help="Safety cap on requests per run.")]
MaxSecOpt = Annotated[float, typer.Option("--max-seconds", help="Safety cap on seconds per run.")]
StrategyOpt = Annotated[
    str,
    typer.Option(
        "--strategy",
        help=f"--emulate without --compare: the in-process gateway's strategy ({', '.join(STRATEGIES)}).",
    ),
]
