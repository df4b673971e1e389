"""Output for people and machines: rich tables, JSON, and a PNG plot (matplotlib, Agg backend).

The plot has two parts: on top, each run's latency distribution (empirical CDF, one line per run);
below, one panel per run with every request drawn as a horizontal bar from start to end on its
instance's row, so a deep queue on one instance shows up as a long tail of late finishes on one line.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import orjson
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from taogate.bench.diagnose import Diagnosis
from taogate.bench.report import IMBALANCE_RATIO, Summary, compare
from taogate.bench.runner import Run, Sample
from taogate.bench.scenarios import Outcome

__all__ = [
    "instance_table",
    "make_console",
    "plot_runs",
    "print_outcomes",
    "progress",
    "render_diagnosis",
    "run_payload",
    "shares_table",
    "summary_table",
    "write_json",
]


def _s(value: float, digits: int = 2) -> str:
    return "-" if math.isnan(value) else f"{value:.{digits}f}"


def _x(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.2f}x"


def summary_table(
    summaries: Sequence[Summary],
    *,
    baseline: Summary | None = None,
    refs: Sequence[Summary] | None = None,
    title: str = "taogate bench",
) -> Table:
    """One row per run: latency, TTFT, the max/mean rule, throughput, errors, and its ratios to
    ``baseline``, or to its own reference of ``refs`` (one per row)."""
    if refs is not None and len({id(r) for r in refs}) == 1:
        baseline, refs = refs[0], None
    rows_refs: Sequence[Summary | None] = refs if refs is not None else [baseline] * len(summaries)
    table = Table(title=title, title_justify="left")
    table.add_column("run", min_width=24)
    for name in ("ok", "mean s", "p50 s", "p90 s", "p99 s", "max s", "min s", "TTFT p50", "TTFT p99"):
        table.add_column(name, justify="right")
    table.add_column("max/mean", justify="right")
    table.add_column("prompt tok/s", justify="right")
    if baseline is not None or refs is not None:
        table.add_column("tput vs ref", justify="right")
        table.add_column("mean vs ref", justify="right")
    table.add_column("errors")
    for s, ref in zip(summaries, rows_refs, strict=True):
        lat, ttft = s.latency, s.ttft
        mm = s.max_over_mean
        flag = "[red]" if s.imbalanced else "[green]" if not math.isnan(mm) else ""
        row = [
            s.label,
            f"{s.ok}/{s.requests}",
            _s(lat.mean),
            _s(lat.p50),
            _s(lat.p90),
            _s(lat.p99),
            _s(lat.max),
            _s(lat.min),
            _s(ttft.p50, 3),
            _s(ttft.p99, 3),
            f"{flag}{_s(mm)}",
            _s(s.prompt_tokens_per_s, 0),
        ]
        if ref is not None:
            r = compare(s, ref)
            row += [_x(r["throughput"]), _x(r["mean_latency"])]
        row.append(", ".join(f"{k}: {v}" for k, v in s.errors.items()) or "-")
        table.add_row(*row)
    table.caption = (
        f"max/mean over {IMBALANCE_RATIO:g} (red) means imbalance remains: some instance queued longer"
        + (f"; ref = {baseline.label}" if baseline is not None else "")
        + ("; ref = the pooled bound with the row's own caching" if refs is not None else "")
    )
    return table


def instance_table(summary: Summary, admin: Mapping[str, Any] | None = None) -> Table:
    """Per-instance load share and completion times; the gateway's view of each instance if given."""
    table = Table(title=f"per instance: {summary.label}", title_justify="left")
    for name, justify in (
        ("instance", "left"),
        ("requests", "right"),
        ("share", "right"),
        ("prompt tokens", "right"),
        ("mean s", "right"),
        ("last finish s", "right"),
    ):
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    rows = {r["name"]: r for r in (admin or {}).get("instances", [])}
    if rows:
        table.add_column("gateway: health", justify="left")
        table.add_column("relative speed", justify="right")
    for name, share in summary.per_instance.items():
        row = [
            name,
            str(share.count),
            f"{share.share:.0%}" if not math.isnan(share.share) else "-",
            str(share.prompt_tokens),
            _s(share.mean_latency),
            _s(share.last_finish),
        ]
        if rows:
            info = rows.get(name, {})
            row += [str(info.get("health", "-")), str(info.get("relative_speed", "-"))]
        table.add_row(*row)
    return table


def write_json(path: Path, payload: Mapping[str, Any]) -> None:
    path.write_bytes(orjson.dumps(payload, option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY))


def plot_runs(path: Path, runs: Sequence[Run], title: str = "taogate bench") -> Path:
    """Write the PNG (latency CDF per run + per-instance request timelines) and return its path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r for r in runs if r.samples]
    panels = max(1, len(runs))
    cols = min(panels, 3)
    rows = 1 + math.ceil(panels / cols)
    fig = plt.figure(figsize=(5.5 * cols, 3.4 * rows), layout="constrained")
    grid = fig.add_gridspec(rows, cols)
    cdf = fig.add_subplot(grid[0, :])
    for run in runs:
        lat = sorted(s.latency for s in run.samples if s.ok)
        if lat:
            cdf.step(lat, [(i + 1) / len(lat) for i in range(len(lat))], where="post", label=run.label)
    cdf.set_xlabel("latency (s)")
    cdf.set_ylabel("fraction of requests")
    cdf.set_title("latency distribution (CDF)")
    cdf.grid(alpha=0.3)
    if runs:
        cdf.legend(fontsize="small", loc="lower right")
    first = None
    horizon = max((s.end for r in runs for s in r.samples), default=1.0)
    for k, run in enumerate(runs):
        ax = fig.add_subplot(grid[1 + k // cols, k % cols], sharex=first)
        first = first or ax
        names = sorted({s.instance or "?" for s in run.samples})
        y = {n: i for i, n in enumerate(names)}
        lanes: dict[str, int] = {}
        for s in sorted(run.samples, key=lambda s: s.start):
            name = s.instance or "?"
            lane = lanes.get(name, 0)
            lanes[name] = lane + 1
            # Each request gets its own thin lane inside its instance's band, so overlaps stay visible.
            level = y[name] - 0.4 + 0.8 * ((lane % 16) / 16)
            color = "tab:blue" if s.ok else "tab:red"
            ax.plot([s.start, s.end], [level, level], color=color, lw=1.2)
            ax.plot([s.end], [level], marker="|", color="black", ms=4)
        ax.set_yticks(range(len(names)), names)
        ax.set_xlim(0, horizon * 1.02)
        ax.set_xlabel("seconds since start (start→end per request; | = done)")
        ax.set_title(run.label, fontsize="small")
        ax.grid(axis="x", alpha=0.3)
    fig.suptitle(title)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


@contextlib.contextmanager
def progress(console: Console, label: str, total: int) -> Iterator[Callable[[Sample], None]]:
    """A progress bar for one run; yields the per-sample callback the runner calls."""
    bar = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("errors {task.fields[errors]}"),
        TimeElapsedColumn(),
        console=console,
        transient=True,
    )
    if not console.is_terminal:  # a pipe or a file: no live bar, no blank lines left behind
        yield lambda _sample: None
        return
    task = bar.add_task(label, total=total, errors=0)
    errors = 0

    def advance(sample: Sample) -> None:
        nonlocal errors
        errors += 0 if sample.ok else 1
        bar.update(task, advance=1, errors=errors)

    with bar:
        yield advance


def shares_table(summaries: Sequence[Summary], title: str = "requests per instance") -> Table:
    """Runs as rows, instances as columns: how the load was spread (count and share)."""
    names = sorted({n for s in summaries for n in s.per_instance})
    table = Table(title=title, title_justify="left")
    table.add_column("run")
    for name in names:
        table.add_column(name, justify="right")
    for s in summaries:
        cells = []
        for name in names:
            share = s.per_instance.get(name)
            cells.append("-" if share is None else f"{share.count} ({_pct(share.share)})")
        table.add_row(s.label, *cells)
    return table


def _pct(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.0%}"


def run_payload(run: Run, summary: Summary, **extra: Any) -> dict[str, Any]:
    """One run for JSON output: its summary and every sample."""
    return {
        "label": run.label,
        "started_at": run.started_at,
        "duration": run.duration,
        "stopped_early": run.stopped_early,
        "summary": summary.as_dict(),
        "samples": [dataclasses.asdict(s) for s in run.samples],
        **extra,
    }


def make_console() -> Console:
    """Wide enough for the comparison tables when output goes to a file or a pipe."""
    return Console() if sys.stdout.isatty() else Console(width=200)


def print_outcomes(console: Console, outcomes: list[Outcome], title: str) -> None:
    """The comparison table (ratios against the pooled bound, else the first row) and load spread."""
    summaries = [o.summary for o in outcomes]
    pooled = {o.scenario.prefix_caching: o.summary for o in reversed(outcomes) if o.scenario.kind == "pooled"}
    if pooled:  # each row against the bound with its own caching (the first bound if none has it)
        first = next(o.summary for o in outcomes if o.scenario.kind == "pooled")
        refs = [pooled.get(o.scenario.prefix_caching, first) for o in outcomes]
        console.print(summary_table(summaries, refs=refs, title=title))
    else:
        baseline = summaries[0] if len(summaries) > 1 else None
        console.print(summary_table(summaries, baseline=baseline, title=title))
    console.print(shares_table(summaries))
    hits = [(o.summary.label, o.cache_hit_rate) for o in outcomes if o.emulator or o.engine_hits]
    if any(not math.isnan(h) and h > 0 for _, h in hits):
        console.print(
            "prefix-cache hit rate (the instances' own counters): "
            + ", ".join(f"{label} {h:.0%}" for label, h in hits)
        )


def render_diagnosis(console: Console, result: Diagnosis) -> None:
    v = result.verdict
    color = {"balanced": "green", "dispatch": "yellow", "slow": "red", "inside": "red"}.get(v.kind, "red")
    console.print(summary_table([result.evidence.configured, result.evidence.lowered], title="bisection"))
    console.print(f"[bold {color}]verdict: {escape(v.headline)}[/bold {color}]")
    for line in v.evidence:  # plain text: the probes' "[slowest-best]" ranges are not markup
        console.print(f"  - {line}", markup=False)
