"""What the gateway's own work per request costs on hostile bodies: µs per MB of body for the
prompt-size estimate, the prefix key, the SSE usage tap and the non-stream usage probe, over shapes
built to be expensive (millions of tiny items, nested pairs, events that never end, one-byte
chunks), at two sizes. Linear work keeps µs/MB flat from one size to the next; bounded work (the
estimate and the key read a fixed number of items) makes it fall. orjson's own parse of the same
body is printed beside it: it is what the gateway pays before any of its own work, and why
``[gateway] max_json_items`` refuses bodies of too many values before parsing them.

Run: ``.venv/bin/python benchmarks/hostile.py [--sizes 4 30] [--repeat 3]`` (sizes in MB; with
``PYTHONPATH`` at another checkout's ``src``, the same shapes against that code). ``--hop``: the
attacks on the proxied hop instead, against ``taogate serve`` (``hop_attacks.py``, its table).
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import orjson

from taogate.dispatch.prefix import shared_prefix
from taogate.dispatch.tokens import measure
from taogate.proxy.usage import UsageTap, usage_of_body


def _best(fn: Callable[[], object], repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def _n(size_mb: float, per_item: int) -> int:
    return max(1, int(size_mb * 1e6 / per_item))


#: (name, route, body builder for a size in MB)
BODIES: list[tuple[str, str, Callable[[float], dict[str, Any]]]] = [
    ("prompt: one-word items", "completions", lambda mb: {"prompt": ["w"] * _n(mb, 4)}),
    ("prompt: lists of words", "completions", lambda mb: {"prompt": [["w"] * 50] * _n(mb, 200)}),
    ("prompt: token ids", "completions", lambda mb: {"prompt": [123456] * _n(mb, 7)}),
    ("prompt: one CJK text", "completions", lambda mb: {"prompt": "你好世界é" * _n(mb, 13)}),
    (
        "chat: tiny messages",
        "chat",
        lambda mb: {"messages": [{"role": "user", "content": "hi"}] * _n(mb, 31)},
    ),
    (
        "chat: one message of tiny parts",
        "chat",
        lambda mb: {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}] * _n(mb, 27)}]},
    ),
    (
        "chat: a huge message in the history",
        "chat",
        lambda mb: {
            "messages": [{"role": "user", "content": "a" * _n(mb, 1)}, {"role": "user", "content": "q"}]
        },
    ),
    ("chat: huge tools", "chat", lambda mb: {"messages": [], "tools": [{"type": "function"}] * _n(mb, 20)}),
    (
        "responses: tiny items",
        "responses",
        lambda mb: {"input": [{"role": "user", "content": "hi"}] * _n(mb, 31)},
    ),
]


def bodies(sizes: list[float], repeat: int) -> list[dict[str, Any]]:
    rows = []
    for name, route, build in BODIES:
        for mb in sizes:
            payload = {"model": "m", **build(mb)}
            raw = orjson.dumps(payload)
            parsed = orjson.loads(raw)
            megabytes = len(raw) / 1e6
            runs: dict[str, Callable[[], object]] = {
                "parse": partial(orjson.loads, raw),
                "estimate": partial(measure, route, parsed),
                "prefix key": partial(shared_prefix, route, parsed),
            }
            row: dict[str, Any] = {"shape": name, "MB": megabytes}
            for what, run in runs.items():
                row[what] = _best(run, repeat) * 1e6 / megabytes
            rows.append(row)
    return rows


def _tap(stream: bytes, chunk: int) -> Callable[[], object]:
    def run() -> object:
        tap = UsageTap()
        for i in range(0, len(stream), chunk):
            tap.feed(stream[i : i + chunk])
        return tap.usage

    return run


def answers(sizes: list[float], repeat: int) -> list[dict[str, Any]]:
    rows = []
    for mb in sizes:
        events = b'data: {"id":"x","choices":[{"index":0,"text":"a"}]}\n\n' * _n(mb, 53)
        endless = b"data: " + b'"usage"' * _n(mb, 7)
        nested = b'{"usage":{"prompt_tokens":1,"x":[' + b",".join([b"{}"] * _n(mb, 3)) + b"]}}"
        cases: list[tuple[str, bytes, Callable[[bytes], Callable[[], object]]]] = [
            ("SSE tap: events, one per chunk", events, lambda s: _tap(s, 53)),
            ("SSE tap: an event that never ends, 1 KiB chunks", endless, lambda s: _tap(s, 1024)),
            ("SSE tap: events, one byte per chunk", events[: len(events) // 64], lambda s: _tap(s, 1)),
            ("usage probe: nested pairs", nested, lambda s: lambda: usage_of_body(s)),
        ]
        for name, data, make in cases:
            megabytes = len(data) / 1e6
            rows.append(
                {"shape": name, "MB": megabytes, "usage": _best(make(data), repeat) * 1e6 / megabytes}
            )
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument(
        "--sizes", type=float, nargs="+", default=[4.0, 30.0], help="body sizes in MB (default 4 30)"
    )
    p.add_argument("--repeat", type=int, default=3, help="best of this many runs (default 3)")
    p.add_argument("--hop", action="store_true", help="the attacks on the proxied hop (hop_attacks.py)")
    args = p.parse_args()
    if args.hop:
        from hop_attacks import main as hop_attacks

        asyncio.run(hop_attacks())
        return
    print(f"µs per MB of body (best of {args.repeat})")
    columns = ("orjson parse", "estimate", "prefix key")
    print(f"| {'request body shape':38} | {'MB':>6} | " + " | ".join(f"{c:>12}" for c in columns) + " |")
    print(f"|{'-' * 40}|{'-' * 8}|" + "|".join("-" * 14 for _ in columns) + "|")
    rows = bodies(args.sizes, args.repeat)
    for r in rows:
        print(
            f"| {r['shape']:38} | {r['MB']:6.1f} | {r['parse']:12,.0f} | {r['estimate']:12,.0f} | "
            f"{r['prefix key']:12,.0f} |"
        )
    largest = [r for r in rows if r["MB"] >= 0.9 * max(args.sizes)]
    worst = max(largest or rows, key=lambda r: r["estimate"] + r["prefix key"])
    print(
        f"worst shape for the gateway's own work, largest size: {worst['shape']} at {worst['MB']:.1f} MB, "
        f"{worst['estimate'] + worst['prefix key']:,.0f} µs/MB (its parse: {worst['parse']:,.0f} µs/MB)"
    )
    print()
    print(f"| {'answer shape':48} | {'MB':>6} | {'usage':>9} |")
    print(f"|{'-' * 50}|{'-' * 8}|{'-' * 11}|")
    usage_rows = answers(args.sizes, args.repeat)
    for r in usage_rows:
        print(f"| {r['shape']:48} | {r['MB']:6.2f} | {r['usage']:9,.0f} |")
    worst = max(usage_rows, key=lambda r: r["usage"])
    print(f"worst shape for the usage tap/probe: {worst['shape']}, {worst['usage']:,.0f} µs/MB")


if __name__ == "__main__":
    main()
