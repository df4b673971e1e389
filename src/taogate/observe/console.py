"""The fleet's side-by-side rows in a terminal: ``taogate status`` once, or ``--watch`` live.

A terminal is often 80 columns wide, and a table that squeezes its columns cuts headers and figures
to "in…": instead the least important columns are left out, whole, until the rest fits, and the view
says which. The verdict's advice for an instance that is not plainly ok goes below the table, where
its length costs no column.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rich.cells import cell_len
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

__all__ = ["COLUMNS", "Column", "fit_columns", "status_view", "table_width", "watch"]

Row = Mapping[str, Any]


def _num(value: Any) -> str:
    if isinstance(value, float) and value.is_integer():  # engine gauges are floats on the wire
        value = int(value)
    return "-" if value is None else str(value)


def _secs(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}" if value < 10 else f"{value:.1f}"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{round(value * 100)}%"


def _ms(value: float | None) -> str:
    """Seconds as milliseconds, at most three figures (a decode pace of 0.0123 s reads 12.3)."""
    return "-" if value is None else f"{value * 1000:.3g}"


def _precise(value: Mapping[str, str] | None) -> str:
    """Precise mode: dispatch on the KV-event index, or on the model and why."""
    if not value:
        return "model"
    return "index" if value["by"] == "index" else f"model ({value['reason'].replace('_', ' ')})"


@dataclass(frozen=True, slots=True)
class Column:
    title: str
    cell: Callable[[Row], str]
    rank: int  # 0: always shown; the highest rank is left out first
    left: bool = False


#: In the order shown; ``rank`` says what goes first when the terminal is narrow.
COLUMNS: tuple[Column, ...] = (
    Column("instance", lambda r: str(r["name"]), 0, left=True),
    Column("health", lambda r: str(r["health"]).replace("_", " "), 2),
    Column("breaker", lambda r: str(r["breaker"]).replace("_", " "), 4),
    Column("channel", lambda r: str(r["role"]), 5),
    Column("in flight", lambda r: f"{r['inflight']}/{r['cap']}", 1),
    Column("prefill tok", lambda r: _num(r.get("prefill_tokens")), 6),
    Column("eng wait", lambda r: _num(r.get("engine_waiting")), 2),
    Column("eng run", lambda r: _num(r.get("engine_running")), 3),
    Column("KV", lambda r: _pct(r.get("kv_usage")), 4),
    Column("cache hit", lambda r: _pct(r.get("prefix_hit_rate")), 5),
    Column("cache by", lambda r: _precise(r.get("precise")), 6),
    Column("req/1m", lambda r: _num(r.get("requests_1m")), 3),
    Column("TTFT p50", lambda r: _secs(r.get("ttft_p50")), 3),
    Column("TTFT p99", lambda r: _secs(r.get("ttft_p99")), 1),
    Column("speed", lambda r: f"{r['relative_speed']:.2f}x", 1),
    Column("ms/out tok", lambda r: _ms(r.get("decode_seconds_per_token")), 5),
    Column("verdict", lambda r: str(r.get("state") or r["verdict"]), 0, left=True),
)


def _width(column: Column, rows: Sequence[Row]) -> int:
    return max([cell_len(column.title), *(cell_len(column.cell(r)) for r in rows)])


def table_width(columns: Sequence[Column], rows: Sequence[Row]) -> int:
    """Terminal cells of the table: each column, a space either side, a rule between and around."""
    return sum(_width(c, rows) for c in columns) + 3 * len(columns) + 1


def fit_columns(rows: Sequence[Row], width: int, columns: Sequence[Column] = COLUMNS) -> list[Column]:
    """The columns to show within ``width`` cells: the highest rank is left out first (of equals, the
    rightmost); rank 0 always stays, even when it alone is too wide."""
    kept = list(columns)
    while table_width(kept, rows) > width:
        droppable = [(c.rank, i) for i, c in enumerate(kept) if c.rank > 0]
        if not droppable:
            break
        kept.pop(max(droppable)[1])
    return kept


def _by_reason(counts: Mapping[str, int]) -> str:
    return ", ".join(f"{n} {k.replace('_', ' ')}" for k, n in counts.items()) or "none"


_STYLE = {"slow": "bold red", "down": "bold", "draining": "yellow"}


def _of(used: float | None, limit: int | None) -> str:
    return f"{_num(None if used is None else round(used))} / {'∞' if limit is None else limit}"


def keys_table(keys: Sequence[Mapping[str, Any]]) -> Table | None:
    """The client keys side by side, once there are named ones (alone, the unified key's row would
    repeat the instances')."""
    if len(keys) < 2:
        return None
    table = Table(title="client keys", caption="window: the current limits window", caption_justify="left")
    for title in ("key", "in flight", "requests, window", "tokens, window", "requests", "tokens", "refused"):
        table.add_column(title, justify="left" if title in ("key", "refused") else "right", no_wrap=True)
    for k in keys:
        window = k.get("window_used") or {}
        cap = k.get("max_concurrency")
        table.add_row(
            str(k["name"]),
            f"{k['in_flight']}" + (f" / {cap}" if cap is not None else ""),
            _of(window.get("requests"), k.get("requests_per_minute")),
            _of(window.get("tokens"), k.get("tokens_per_minute")),
            str(k["requests"]),
            str(k["prompt_tokens"] + k["completion_tokens"]),
            _by_reason(k.get("rejections") or {}),
        )
    return table


def status_view(data: Mapping[str, Any], base: str, width: int) -> RenderableType:
    """One ``GET /admin/instances`` answer: the table that fits ``width``, then notes below it."""
    rows: list[Row] = data["instances"]
    columns = fit_columns(rows, width)
    gw = data.get("gateway") or {}
    queue = f"{data['queued']} waiting in the gateway queue"
    if gw:
        affinity = " + prefix affinity" if gw.get("prefix_affinity") else ""
        seconds = round(gw.get("recent_seconds", 60))
        caption = (
            f"{gw['strategy']}{affinity}; last {seconds} s: rejected {_by_reason(gw['rejections'])}, "
            f"retried {_by_reason(gw['retries'])}"
        )
    else:
        caption = None
    table = Table(title=f"taogate at {base}: {queue}", caption=caption, caption_justify="left")
    for c in columns:
        table.add_column(c.title, justify="left" if c.left else "right", no_wrap=True)
    for row in rows:
        table.add_row(*(c.cell(row) for c in columns), style=_STYLE.get(str(row.get("state")), ""))
    notes = [
        Text(f"{row['name']}: {row['verdict']}", style=_STYLE.get(str(row.get("state")), ""))
        for row in rows
        if row["verdict"] not in ("ok", row.get("state"))  # only where it says more than the table
    ]
    hidden = [c.title for c in COLUMNS if c not in columns]
    if hidden:
        notes.append(Text(f"left out to fit {width} columns: {', '.join(hidden)}", style="dim"))
    keys = keys_table(data.get("keys") or [])
    return Group(table, *([keys] if keys is not None else []), *notes)


def watch(
    fetch: Callable[[], Mapping[str, Any] | str],
    base: str,
    console: Console,
    *,
    interval: float = 1.0,
    sleep: Callable[[float], None] = time.sleep,
) -> None:
    """Redraw the view in place every ``interval`` seconds until interrupted. ``fetch`` returns the
    status, or a string saying why the gateway is unreachable (said, then retried); whatever it
    raises ends the watch."""
    with Live(console=console, auto_refresh=False, transient=False) as live:
        while True:
            data = fetch()
            if isinstance(data, str):
                view: RenderableType = Text(f"{data}; retrying every {interval:g} s", style="bold red")
            else:
                view = status_view(data, base, console.width)
            stamp = Text(time.strftime("%H:%M:%S") + "  (Ctrl-C to stop)", style="dim")
            live.update(Group(view, stamp), refresh=True)
            sleep(interval)
