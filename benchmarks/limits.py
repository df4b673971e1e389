"""What client keys' limits cost, and how well two replicas hold one limit through Redis.

One run, side by side on this machine:

* in-process CPU: the key check (SHA-256 and a dict lookup) and the limits check plus its release
  (sliding windows in this process), per request, against the unified key's path (no limits), on
  ``time.process_time`` over many iterations in this process;
* Redis on loopback: a check's round trip (one Lua script call, redis-py asyncio) p50/p99, and end
  to end through a ``taogate serve`` process with ``[limits] store``: sequential requests to instant
  emulators, the limited key's (one Redis round trip before dispatch) interleaved with the unified
  key's (none); the added p50 is the difference of the two medians;
* with ``--minute``: two ``taogate serve`` replicas sharing one Redis and a 600-requests-per-minute
  key, offered twice that in turn for a minute after a first minute fills the window: admitted
  against the 600 the limit allows.

Redis is Debian's ``redis-server``, started here on a free port and stopped after.
Run: ``.venv/bin/python benchmarks/limits.py [--iterations 200000] [--requests 2000] [--minute]``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import shutil
import socket
import statistics
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path

import aiohttp
import httpx
from fleetprocs import emulators, gateway

from taogate.bench.procs import free_port
from taogate.key_settings import LimitsSettings
from taogate.proxy.auth import KeyCheck
from taogate.tenancy.fairshare import FairShare
from taogate.tenancy.keys import KeyTable, Tenant
from taogate.tenancy.limiter import Limiter
from taogate.tenancy.store import RedisStore

API_KEY = "limits-bench-unified"
TEAM_KEY = "limits-bench-team-key"
MODEL = "emulated-model"


def _per_call_us(fn: Callable[[], object], n: int) -> float:
    start = time.process_time()
    for _ in range(n):
        fn()
    return (time.process_time() - start) / n * 1e6


async def _per_call_async_us(fn: Callable[[], Awaitable[object]], n: int) -> float:
    start = time.process_time()
    for _ in range(n):
        await fn()
    return (time.process_time() - start) / n * 1e6


async def in_process(n: int) -> dict[str, float]:
    """CPU µs per request of the key check and of the limits, against the unified key's path."""
    team = Tenant("team", requests_per_minute=10**9, tokens_per_minute=10**12, max_concurrency=10**6)
    unified = Tenant("unified")
    table = KeyTable(unified, {hashlib.sha256(TEAM_KEY.encode()).digest(): team})
    limiter = Limiter(table, LimitsSettings(), clock=time.monotonic, fair=FairShare())
    check = KeyCheck(API_KEY, None, table)
    named = [(b"authorization", b"Bearer " + TEAM_KEY.encode())]
    plain = [(b"authorization", b"Bearer " + API_KEY.encode())]

    async def limited() -> None:
        limiter.finish(await limiter.check(team, MODEL, 300), 100, 200, served=True)

    async def unlimited() -> None:
        limiter.finish(await limiter.check(unified, MODEL, 300), 100, 200, served=True)

    out: dict[str, list[float]] = {k: [] for k in ("auth_unified", "auth_named", "limits_none", "limits")}
    for _ in range(3):  # interleaved rounds, the median kept: the machine is shared
        out["auth_unified"].append(_per_call_us(lambda: check.check_request(plain, either=False), n))
        out["auth_named"].append(_per_call_us(lambda: check.check_request(named, either=False), n))
        out["limits_none"].append(await _per_call_async_us(unlimited, n))
        out["limits"].append(await _per_call_async_us(limited, n))
    return {k: statistics.median(v) for k, v in out.items()}


@contextlib.contextmanager
def redis_server(binary: str) -> Iterator[str]:
    port = free_port()
    args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(500):  # bounded: up to 10 s for it to listen
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
                break
            time.sleep(0.02)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.kill()
        proc.wait(5)


def _pct(values: list[float], q: float) -> float:
    return sorted(values)[min(len(values) - 1, int(q * len(values)))]


async def redis_round_trip(url: str, n: int) -> dict[str, float]:
    """A check's round trip through the limiter (asyncio.timeout, the script, the reply), in ms."""
    team = Tenant("team", requests_per_minute=10**9, tokens_per_minute=10**12)
    store = RedisStore(url, timeout=1.0)
    limiter = Limiter(
        KeyTable(Tenant("unified"), {b"\x01" * 32: team}),
        LimitsSettings(store=url, store_timeout=1.0),
        clock=time.monotonic,
        fair=FairShare(),
        store=store,
    )
    took = []
    cpu = time.process_time()
    for _ in range(n):
        start = time.perf_counter()
        limiter.finish(await limiter.check(team, MODEL, 300), None, None, served=True)
        took.append((time.perf_counter() - start) * 1000)
    cpu_us = (time.process_time() - cpu) / n * 1e6
    await limiter.aclose()
    return {"p50_ms": _pct(took, 0.5), "p99_ms": _pct(took, 0.99), "client_cpu_us": cpu_us}


def _limits_toml(url: str, rpm: int, window: float = 60.0) -> str:
    digest = hashlib.sha256(TEAM_KEY.encode()).hexdigest()
    return (
        f'\n[limits]\nstore = "{url}"\nstore_timeout = 0.5\nwindow = {window}\n'
        f'\n[[keys]]\nname = "team"\nkey_sha256 = "{digest}"\nrequests_per_minute = {rpm}\n'
    )


@contextlib.asynccontextmanager
async def served(workdir: Path, urls: list[str], extra: str) -> AsyncIterator[str]:
    await asyncio.to_thread(workdir.mkdir, parents=True, exist_ok=True)
    async with gateway(workdir, urls, "warning", API_KEY, extra=extra) as child:
        yield child.url


async def end_to_end(url: str, workdir: Path, requests: int) -> dict[str, float]:
    """Sequential requests, the limited key's interleaved with the unified key's: the medians."""
    async with (
        emulators(2, workdir / "emulators.log") as emu,
        served(workdir / "gw", emu.urls, _limits_toml(url, 10**9)) as gw,
        aiohttp.ClientSession() as session,
    ):
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 1}
        times: dict[str, list[float]] = {"unified": [], "limited": []}
        for i in range(requests * 2 + 200):
            which = "limited" if i % 2 else "unified"
            auth = {"authorization": f"Bearer {TEAM_KEY if which == 'limited' else API_KEY}"}
            start = time.perf_counter()
            async with session.post(gw + "/v1/completions", json=body, headers=auth) as r:
                await r.read()
                assert r.status == 200, r.status
            if i >= 200:  # after a warm-up
                times[which].append((time.perf_counter() - start) * 1000)
    p50 = {k: statistics.median(v) for k, v in times.items()}
    return {
        "unified_p50_ms": p50["unified"],
        "limited_p50_ms": p50["limited"],
        "added_p50_ms": p50["limited"] - p50["unified"],
    }


async def offered(urls: list[str], seconds: float, rate: float) -> list[tuple[float, int, bool]]:
    """Requests to the replicas in turn at ``rate``/s for ``seconds``: for each, when its answer
    came (monotonic), its status, and whether the shared count admitted it (rate-limit headers:
    without them, a 200 was admitted while the store did not answer, fail_open)."""
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 1}
    auth = {"authorization": f"Bearer {TEAM_KEY}"}

    async def one(h: httpx.AsyncClient, url: str) -> tuple[float, int, bool]:
        r = await h.post(url + "/v1/completions", json=body)
        return time.monotonic(), r.status_code, "x-ratelimit-limit-requests" in r.headers

    async with httpx.AsyncClient(timeout=30, headers=auth) as h:
        tasks: list[asyncio.Task[tuple[float, int, bool]]] = []
        start = time.monotonic()
        while (elapsed := time.monotonic() - start) < seconds:
            tasks.append(asyncio.create_task(one(h, urls[len(tasks) % len(urls)])))
            await asyncio.sleep(max(0.0, len(tasks) / rate - elapsed))
        answers = await asyncio.gather(*tasks)
    assert {status for _, status, _ in answers} <= {200, 429}, {status for _, status, _ in answers}
    return answers


async def admitted_total(h: httpx.AsyncClient, urls: list[str]) -> float:
    """``taogate_key_requests_total`` of the limited key, summed over the replicas' /metrics."""
    total = 0.0
    for url in urls:
        for line in (await h.get(url + "/metrics")).text.splitlines():
            if line.startswith('taogate_key_requests_total{key="team"}'):
                total += float(line.split()[-1])
    return total


async def shared_minute(url: str, workdir: Path) -> dict[str, float]:
    """Two replicas, one 600/min limit, 20/s offered for a minute to fill the window, then 70 s
    more: the requests the replicas admitted between their /metrics at the fifth second and at the
    sixty-fifth (load on both sides of that minute; read at the replicas, so a client that falls
    behind does not stretch or squeeze it)."""
    async with emulators(2, workdir / "emulators-minute.log") as emu:
        extra = _limits_toml(url, 600)
        async with (
            served(workdir / "a", emu.urls, extra) as a,
            served(workdir / "b", emu.urls, extra) as b,
            httpx.AsyncClient(timeout=30) as h,
        ):
            await offered([a, b], 60.0, 20.0)
            load = asyncio.create_task(offered([a, b], 70.0, 20.0))
            await asyncio.sleep(5.0)
            first, at = await admitted_total(h, [a, b]), time.monotonic()
            await asyncio.sleep(60.0 - (time.monotonic() - at))
            last, span = await admitted_total(h, [a, b]), time.monotonic() - at
            answers = await load
    open_ = sum(status == 200 and not shared for _, status, shared in answers)
    counted = last - first
    return {
        "counted": counted,
        "span": span,
        "store_down": open_,
        "sent": len(answers),
        "ratio": counted / 600,
    }


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=200_000)
    parser.add_argument("--requests", type=int, default=2_000)
    parser.add_argument("--minute", action="store_true", help="also the two replicas' shared minute")
    parser.add_argument("--only-minute", action="store_true", help="only the two replicas' shared minute")
    args = parser.parse_args()
    binary = shutil.which("redis-server")
    if args.only_minute and binary is not None:
        with redis_server(binary) as url, tempfile.TemporaryDirectory(prefix="taogate-limits-") as tmp:
            print(await shared_minute(url, Path(tmp)))
        return
    print("in-process, CPU µs per request (median of 3 interleaved rounds):")
    cpu = await in_process(args.iterations)
    for name, value in cpu.items():
        print(f"  {name:14s} {value:8.2f}")
    print(f"  key check added for a named key: {cpu['auth_named'] - cpu['auth_unified']:.2f} µs")
    print(f"  limits check + release added:    {cpu['limits'] - cpu['limits_none']:.2f} µs")
    if binary is None:
        print("redis-server not installed: apt-get install redis-server")
        return
    with redis_server(binary) as url, tempfile.TemporaryDirectory(prefix="taogate-limits-") as tmp:
        trip = await redis_round_trip(url, args.requests)
        print(
            f"Redis on loopback, a check's round trip: p50 {trip['p50_ms']:.3f} ms, "
            f"p99 {trip['p99_ms']:.3f} ms, {trip['client_cpu_us']:.0f} µs CPU here"
        )
        e2e = await end_to_end(url, Path(tmp), args.requests)
        print(
            f"end to end, sequential: unified p50 {e2e['unified_p50_ms']:.3f} ms, limited (Redis) p50 "
            f"{e2e['limited_p50_ms']:.3f} ms, added {e2e['added_p50_ms']:.3f} ms"
        )
        if args.minute:
            minute = await shared_minute(url, Path(tmp))
            print(
                f"two replicas, 600/min shared, a minute after the first: {minute['counted']:.0f} admitted "
                f"in "
                f"{minute['span']:.1f} s by their own counts ({minute['ratio']:.3f} of the limit); "
                f"{minute['store_down']} of {minute['sent']} answered while the store did not (fail_open)"
            )


if __name__ == "__main__":
    asyncio.run(main())
