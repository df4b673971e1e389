"""Soak: thousands of concurrent streaming clients through one gateway process, in rounds.

Three processes on 127.0.0.1: 4 emulated vLLM instances (token-by-token streams, a large running
batch), the gateway (``taogate serve``, caps raised so the whole crowd is admitted), and this load
generator (aiohttp). Each round opens ``--clients`` streams at once and reads each to its end; a
stream counts as good only when it ends with ``data: [DONE]`` and carries no error event. After each
round the gateway's RSS is read from /proc: stable memory across rounds means nothing is kept per
request (leases, tasks, buffers). Bounded: a fixed number of rounds and a per-round timeout.

Run: ``.venv/bin/python benchmarks/soak.py [--clients 2000] [--rounds 3] [--tokens 20]``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
from fleetprocs import emulators, gateway

from taogate.bench.procs import cpu_seconds, rss_bytes

API_KEY = "soak-bench-key"
MODEL = "emulated-model"
ROUND_TIMEOUT_S = 300.0


@dataclass
class Round:
    ok: int = 0
    bad: int = 0
    statuses: dict[int, int] = field(default_factory=dict)
    latencies: list[float] = field(default_factory=list)
    wall: float = 0.0
    rss_after: int = 0
    rss_peak: int = 0
    cpu: float = 0.0


async def one_stream(http: aiohttp.ClientSession, url: str, i: int, tokens: int, rnd: Round) -> None:
    body = {"model": MODEL, "prompt": f"soak client {i} says hello", "max_tokens": tokens, "stream": True}
    t0 = time.monotonic()
    try:
        async with http.post(url, json=body) as r:
            data = await r.read()
            rnd.statuses[r.status] = rnd.statuses.get(r.status, 0) + 1
            good = r.status == 200 and data.endswith(b"data: [DONE]\n\n") and b'"error"' not in data
    except (aiohttp.ClientError, TimeoutError):
        good = False
    rnd.latencies.append(time.monotonic() - t0)
    if good:
        rnd.ok += 1
    else:
        rnd.bad += 1


async def run_round(url: str, pid: int, clients: int, tokens: int) -> Round:
    rnd = Round()
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    headers = {"authorization": f"Bearer {API_KEY}"}
    timeout = aiohttp.ClientTimeout(total=ROUND_TIMEOUT_S)
    c0 = cpu_seconds(pid)
    t0 = time.monotonic()
    async with aiohttp.ClientSession(connector=connector, headers=headers, timeout=timeout) as http:
        work = asyncio.gather(*(one_stream(http, url, i, tokens, rnd) for i in range(clients)))
        sampler_done = asyncio.Event()

        async def sample_rss() -> None:
            while not sampler_done.is_set():
                rnd.rss_peak = max(rnd.rss_peak, rss_bytes(pid))
                await asyncio.sleep(0.25)

        sampler = asyncio.create_task(sample_rss())
        await asyncio.wait_for(work, ROUND_TIMEOUT_S)
        sampler_done.set()
        await sampler
    rnd.wall = time.monotonic() - t0
    rnd.cpu = cpu_seconds(pid) - c0
    await asyncio.sleep(1.0)  # let the gateway finish its bookkeeping before reading memory
    rnd.rss_after = rss_bytes(pid)
    return rnd


async def main_async(args: argparse.Namespace, workdir: Path) -> int:
    emu_args = ("--max-num-seqs", "1024", "--max-num-batched-tokens", "16384", "--decode-tps", "200000")
    per_instance = args.clients // 4 + 64
    extra = (
        "[dispatch]\n"
        f"max_queue_per_instance = {per_instance}\n"
        f"queue_size = {args.clients}\n"
        "queue_timeout = 120\n"
    )
    async with contextlib.AsyncExitStack() as stack:
        emu = await stack.enter_async_context(emulators(4, workdir / "emulators.log", emu_args))
        gw = await stack.enter_async_context(
            gateway(workdir, emu.urls, args.log_level, API_KEY, extra=extra, max_connections=per_instance * 4)
        )
        gw_url = gw.url
        rss0 = rss_bytes(gw.pid)
        print(f"gateway pid {gw.pid}, RSS at start {rss0 / 2**20:.1f} MiB; {args.clients} concurrent streams")
        rounds = []
        for n in range(1, args.rounds + 1):
            rnd = await run_round(gw_url + "/v1/completions", gw.pid, args.clients, args.tokens)
            rounds.append(rnd)
            lat = sorted(rnd.latencies)
            p50, p99 = statistics.median(lat), lat[int(0.99 * len(lat))]
            print(
                f"round {n}: {rnd.ok}/{rnd.ok + rnd.bad} streams good, statuses {rnd.statuses}, "
                f"wall {rnd.wall:.1f}s, p50 {p50:.2f}s, p99 {p99:.2f}s, "
                f"gateway CPU {rnd.cpu:.1f}s, RSS peak {rnd.rss_peak / 2**20:.1f} MiB, "
                f"after {rnd.rss_after / 2**20:.1f} MiB"
            )
        growth = (rounds[-1].rss_after - rounds[0].rss_after) / 2**20
        errors = sum(r.bad for r in rounds)
        print(f"errors: {errors}; RSS after round 1 → round {len(rounds)}: {growth:+.1f} MiB")
        if errors:
            log = (workdir / f"gateway-{args.log_level}.log").read_text(errors="replace").splitlines()
            notable = [ln for ln in log if "taogate.access" not in ln][-30:]
            print("gateway log (all but access lines, tail):\n" + "\n".join(notable))
        return 0 if errors == 0 else 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=2000, help="concurrent streams per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=20, help="max_tokens per stream")
    parser.add_argument("--log-level", default="warning", help="the gateway's log level")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="taogate-soak-") as tmp:
        sys.exit(asyncio.run(main_async(args, Path(tmp))))


if __name__ == "__main__":
    main()
