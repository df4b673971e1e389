"""The terminal view fits its width by leaving out whole columns, least important first, and never
cuts a header or a figure."""

from __future__ import annotations

import io
import signal
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from rich.cells import cell_len
from rich.console import Console

from taogate.observe.console import COLUMNS, fit_columns, status_view, table_width, watch


def row(name: str, **over: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "name": name,
        "role": "any",
        "health": "up",
        "breaker": "closed",
        "draining": False,
        "inflight": 12,
        "cap": 32,
        "prefill_tokens": 48_213,
        "engine_waiting": 7,
        "engine_running": 16,
        "kv_usage": 0.734,
        "prefix_hit_rate": 0.41,
        "requests_1m": 1_234,
        "ttft_p50": 0.412,
        "ttft_p99": 12.5,
        "relative_speed": 1.02,
        "decode_seconds_per_token": 0.0123,
        "state": "ok",
        "verdict": "ok",
    }
    return base | over


ROWS = [
    row("10.0.0.11:8000"),
    row("10.0.0.12:8000", relative_speed=0.38, state="slow", verdict="slow (0.38x median): look inside"),
    row("10.0.0.13:8000", health="down", state="down", verdict="down", engine_waiting=None),
]
ANSWER = {
    "queued": 3,
    "gateway": {
        "strategy": "least_busy",
        "prefix_affinity": True,
        "queued": 3,
        "queue_size": 256,
        "recent_seconds": 60,
        "rejections": {"queue_full": 2},
        "retries": {},
    },
    "instances": ROWS,
}


def render(width: int) -> list[str]:
    console = Console(width=width, record=True, color_system=None)
    console.print(status_view(ANSWER, "http://127.0.0.1:8080", width))
    return console.export_text().splitlines()


def test_eighty_columns_keep_what_matters_and_cut_nothing() -> None:
    kept = [c.title for c in fit_columns(ROWS, 80)]
    for title in ("instance", "in flight", "TTFT p99", "speed", "verdict"):
        assert title in kept
    assert len(kept) < len(COLUMNS)
    lines = render(80)
    assert all(cell_len(line) <= 80 for line in lines), lines
    text = "\n".join(lines)
    assert "…" not in text
    header = next(line for line in lines if "instance" in line)
    for title in kept:
        assert title in header, (title, header)
    assert "left out to fit 80 columns:" in text
    assert "10.0.0.12:8000: slow (0.38x median): look inside" in text
    assert "rejected 2 queue full" in text


def test_a_wide_terminal_shows_every_column() -> None:
    assert fit_columns(ROWS, 250) == list(COLUMNS)
    text = "\n".join(render(250))
    assert "left out" not in text and "cache hit" in text and "prefill tok" in text
    assert "ms/out tok" in text and " 12.3 " in text  # the decode pace, 0.0123 s per output token


def test_the_least_important_go_first() -> None:
    widths = range(table_width(COLUMNS, ROWS), 20, -1)
    dropped_order: list[str] = []
    for w in widths:
        for c in COLUMNS:
            if c not in fit_columns(ROWS, w) and c.title not in dropped_order:
                dropped_order.append(c.title)
    ranks = {c.title: c.rank for c in COLUMNS}
    assert [ranks[t] for t in dropped_order] == sorted((ranks[t] for t in dropped_order), reverse=True)
    assert "instance" not in dropped_order and "verdict" not in dropped_order


names = st.text(st.characters(min_codepoint=33, max_codepoint=126), min_size=1, max_size=30)


@settings(max_examples=100, deadline=None)
@given(
    width=st.integers(10, 300),
    extra=st.integers(0, 60),
    fleet=st.lists(
        st.tuples(
            names, st.integers(0, 10**6), st.floats(0, 500), st.sampled_from(["ok", "slow", "draining"])
        ),
        min_size=1,
        max_size=8,
    ),
)
def test_fitting_is_within_width_and_monotone(
    width: int, extra: int, fleet: list[tuple[str, int, float, str]]
) -> None:
    rows = [row(n, prefill_tokens=p, ttft_p99=t, state=s) for n, p, t, s in fleet]
    kept = fit_columns(rows, width)
    assert [c for c in COLUMNS if c.rank == 0] == [c for c in kept if c.rank == 0]
    if any(c.rank > 0 for c in kept):
        assert table_width(kept, rows) <= width
    wider = fit_columns(rows, width + extra)
    assert set(kept) <= set(wider)
    dropped = [c for c in COLUMNS if c not in kept]
    if dropped:
        assert min(c.rank for c in dropped) >= max(c.rank for c in kept)


def _quiet_console() -> Console:
    return Console(file=io.StringIO(), width=80, color_system=None)


def test_ctrl_c_between_fetches_ends_the_watch_at_once() -> None:
    fetched: list[int] = []

    def fetch() -> str:
        fetched.append(1)
        return "unreachable"

    def sleep(_: float) -> None:
        signal.raise_signal(signal.SIGINT)  # in this thread: handled before it returns
        raise AssertionError("the interrupt did not end the sleep")

    with pytest.raises(KeyboardInterrupt):
        watch(fetch, "http://127.0.0.1:1", _quiet_console(), sleep=sleep)
    assert fetched == [1]
