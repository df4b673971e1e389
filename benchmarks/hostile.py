"""What the gateway's own work per request costs on hostile bodies: µs per MB of body for the
prompt-size estimate, the prefix key, the SSE usage tap and the non-stream usage probe, over shapes
built to be expensive (millions of tiny items, nested pairs, events that never end, one-byte
chunks), at two sizes. Linear work keeps µs/MB flat from one size to the next; bounded work (the
estimate and the key read a fixed number of items) makes it fall. orjson's own parse of the same
body is printed beside it: it is what the gateway pays before any of its own work, and why
``[gateway] max_json_items`` refuses bodies of too many values before parsing them.

Run: ``.venv/bin/python benchmarks/hostile.py [--sizes 4 30] [--repeat 3]`` (sizes in MB; with
``PYTHONPATH`` at another checkout's ``src``, the same shapes against that code).

``--attacks [NAME ...]``: the attacks of ``ATTACKS`` instead, each against ``taogate serve`` in a
process of its own (an instant emulator and a scripted instance behind it) beside a normal client:
the normal request's worst and median latency, the gateway's CPU and RSS growth, and how long until
its instance slots and file descriptors were back to their baseline.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import orjson
from fleetprocs import emulators, gateway

from taogate.bench.procs import cpu_seconds, rss_bytes
from taogate.dispatch.prefix import shared_prefix
from taogate.dispatch.tokens import measure
from taogate.proxy.usage import UsageTap, usage_of_body

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the scripted peers: tests/hostile
from tests.conftest import KEY
from tests.hostile import attacks as hostile
from tests.hostile import hop
from tests.hostile.helpers import Neighbour, ScriptedInstance


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


# -- attacks against a running gateway ---------------------------------------------------------------
# Each attack is a row: how to set the gateway up and what the attacker does. The attacker's own
# work runs in threads of this process; the gateway in its own, so its CPU and memory are its own.


@dataclass(frozen=True)
class Attack:
    name: str
    attack: Callable[[str], str]  # (gateway url) → what the attacker saw, in a few words
    answer: hostile.Answer | None = None  # the scripted instance's answer, if the attack needs one
    gateway: str = ""  # config.toml lines for the gateway's [gateway] table
    dispatch: str = ""  # and for its [dispatch] table
    limit_s: float = 120.0  # the attack's own bound (it stops by itself well before)


#: The rows; another branch adds its own attacks here.
ATTACKS: list[Attack] = [
    Attack(
        "8 multipart uploads stalled after `model`",
        hostile.stalled_uploads,
        hostile.swallow,
        gateway="body_timeout = 2\n",
        dispatch="max_queue_per_instance = 4\n",
    ),
    Attack("16 /metrics loops, 5 s", hostile.metrics_loops),
    Attack("300 /metrics pollers at 1 Hz, 8 s", hostile.metrics_pollers),
    Attack("20 streams cut inside an event (OpenAI SDK)", hostile.cut_streams, hostile.cut_inside_an_event),
    Attack("40 chat bodies nested 1,000 deep", hostile.deep_bodies),
    Attack("/v1/messages of 450k blocks, 3 times", hostile.many_blocks),
    Attack("100 Responses ids of 1 MiB", hostile.huge_response_ids),
    # the proxied hop's (tests/hostile/hop.py)
    Attack("30 paths with percent-encoded CR LF, NUL, space", hop.injection, hop.echo_injection),
    Attack("8 answers failing after 60 MiB, 3 rounds", hop.failed_answers, hop.sixty_mib_then_close),
]


@dataclass
class Figures:
    name: str
    seen: str = ""
    worst_ms: float = 0.0
    p50_ms: float = 0.0
    neighbour_errors: int = 0
    cpu_s: float = 0.0
    rss_mib: float = 0.0
    slots_back_s: float | None = None
    fds_back_s: float | None = None
    notes: list[str] = field(default_factory=list)


def _fds(pid: int) -> int:
    return sum(1 for _ in Path(f"/proc/{pid}/fd").iterdir())


def _busy(url: str) -> int:
    r = httpx.get(url + "/admin/instances", headers={"authorization": f"Bearer {KEY}"}, timeout=10)
    body = r.json()
    return int(body["queued"]) + sum(int(i["inflight"]) for i in body["instances"])


async def _until(check: Callable[[], bool], within: float) -> float | None:
    """Seconds until ``check()`` held (polled every 50 ms), None if not within ``within``."""
    t = time.perf_counter()
    while time.perf_counter() - t < within:
        if await asyncio.to_thread(check):
            return time.perf_counter() - t
        await asyncio.sleep(0.05)
    return None


async def run_attack(row: Attack, workdir: Path, emulator_url: str) -> Figures:
    figures = Figures(row.name)
    scripted = ScriptedInstance(row.answer) if row.answer is not None else None
    urls = [emulator_url, *([scripted.url] if scripted else [])]
    config = row.gateway + "[dispatch]\nbreaker_failures = 1000\n" + row.dispatch
    if scripted is not None:
        scripted.__enter__()
    try:
        async with gateway(workdir, urls, "warning", KEY, extra=config) as gw:
            pid, url = gw.pid, gw.url
            await asyncio.sleep(1.0)  # the first probes and scrapes settle
            fds, rss, cpu = _fds(pid), rss_bytes(pid), cpu_seconds(pid)
            neighbour = Neighbour(url)
            neighbour.start()
            try:
                figures.seen = await asyncio.wait_for(asyncio.to_thread(row.attack, url), row.limit_s)
            finally:
                neighbour.stop()
                await asyncio.to_thread(neighbour.join, 15)
            figures.cpu_s = cpu_seconds(pid) - cpu
            figures.rss_mib = (rss_bytes(pid) - rss) / 2**20
            lat = neighbour.latencies or [0.0]
            figures.worst_ms, figures.p50_ms = max(lat) * 1e3, statistics.median(lat) * 1e3
            figures.neighbour_errors = len(neighbour.errors)
            figures.notes = neighbour.errors[:2]
            figures.slots_back_s = await _until(lambda: _busy(url) == 0, 30)
            figures.fds_back_s = await _until(lambda: _fds(pid) <= fds, 30)
    finally:
        if scripted is not None:
            scripted.__exit__(None, None, None)
    return figures


async def attacks(names: list[str]) -> list[Figures]:
    rows = [a for a in ATTACKS if not names or any(n.lower() in a.name.lower() for n in names)]
    out = []
    with tempfile.TemporaryDirectory(prefix="hostile-") as tmp:
        workdir = Path(tmp)
        async with emulators(1, workdir / "emulators.log") as emu:
            for row in rows:
                print(f"… {row.name}", file=sys.stderr, flush=True)
                out.append(await run_attack(row, workdir, emu.url))
    return out


def _back(seconds: float | None) -> str:
    return "not in 30 s" if seconds is None else f"{seconds:.1f} s"


def print_attacks(rows: list[Figures]) -> None:
    head = (
        "attack",
        "what the attacker saw",
        "worst",
        "p50",
        "errors",
        "CPU",
        "RSS",
        "slots back",
        "fds back",
    )
    print("| " + " | ".join(head) + " |")
    print("|" + "|".join("---" for _ in head) + "|")
    for f in rows:
        cells = (
            f.name,
            f.seen,
            f"{f.worst_ms:,.0f} ms",
            f"{f.p50_ms:,.1f} ms",
            str(f.neighbour_errors),
            f"{f.cpu_s:.2f} s",
            f"{f.rss_mib:+.0f} MiB",
            _back(f.slots_back_s),
            _back(f.fds_back_s),
        )
        print("| " + " | ".join(cells) + " |")
        for note in f.notes:
            print(f"  neighbour: {note[:160]}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument(
        "--sizes", type=float, nargs="+", default=[4.0, 30.0], help="body sizes in MB (default 4 30)"
    )
    p.add_argument("--repeat", type=int, default=3, help="best of this many runs (default 3)")
    p.add_argument(
        "--attacks", nargs="*", metavar="NAME", help="run the attacks (those whose name contains NAME)"
    )
    args = p.parse_args()
    if args.attacks is not None:
        print_attacks(asyncio.run(attacks(args.attacks)))
        return
    per_mb(args)


def per_mb(args: argparse.Namespace) -> None:
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
