"""What the gateway adds over going direct to vLLM: latency, throughput and the gateway's own CPU.

One run, side by side on this machine, each server in its own process so its CPU is measured alone:

* 4 instant emulators (engine bypassed) in one process: ``python -m taogate.emulator --fleet 4 --instant``;
* the gateway: ``taogate serve`` over a temporary config.toml naming the 4 emulators;
* the reference proxies (``reference_proxy.py``: FastAPI with aiohttp, and with httpx's default
  transport; ``bare``, the gateway's own listener and ``h1`` pool with none of its
  features: the floor of this stack; and nginx's ``least_conn`` when installed: Debian's ``nginx``,
  run as a subprocess on loopback): this shared machine's speed moves with its neighbours, so the
  CPU target is also judged as a ratio to them, measured in the same rounds;
* this process: the load generator (aiohttp directly, on uvloop: the cheapest client, so it steals
  the least CPU from the gateway).

Each round runs, interleaved: tiny non-stream /v1/completions direct (round-robin over the
emulators), the same through a gateway logging at ``warning``, the same through a second gateway
with the shipped default (``info``: the access log on; the targets are judged on it), the same
through each reference proxy, then streaming /v1/completions direct and through the gateway, then
the paced pair. Each server's CPU comes from ``/proc/<pid>/stat`` (utime + stime) around each phase:

* CPU per proxied request = Δcpu / requests;
* CPU per relayed SSE event = (Δcpu − streams × CPU per request of the same round) / events,
  where events are the ``data: `` lines the client received.

A closed loop of 32 workers over instant emulators is a throughput limit (added ≈ 32/gateway_rps −
32/direct_rps), not the latency a request sees at real LLM request rates. Its router, emulators and
client share this machine's cores, so no router can add less than 32 × the CPU it costs them all per
request / cores (printed beside each row, with the cores the loop kept busy); what it adds above
that is time no process worked. A paced phase pair measures the latency at a real rate: open-loop
arrivals at ``--paced-rate`` requests/s (at most ``--concurrency`` in flight), direct and through the
gateway.

Figures are the median over rounds; the machine is shared, so compare within one run only.
Run: ``.venv/bin/python benchmarks/overhead.py [--requests 4000] [--rounds 3] [--json out.json]``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from fleetprocs import ROUTER_POLICIES, emulators, gateway, reference
from peers import available

from taogate.bench.procs import Child, cpu_seconds, free_port

MODEL = "emulated-model"
API_KEY = "overhead-bench-key"
REQUEST_TIMEOUT_S = 30.0
PHASE_TIMEOUT_S = 600.0
IDLE_WINDOW_S = 3.0

# The gateway's overhead targets, judged on the shipped default config (metrics and the access log
# on: the log-info gateway) when that phase runs.
TARGET_CPU_PER_REQUEST_US = 100.0
TARGET_CPU_PER_EVENT_US = 3.0
TARGET_ADDED_P50_MS = 2.0
#: The cores the closed loop shares: the router, the emulators and the load client all run here.
CORES = os.cpu_count() or 1
# The reference proxies were measured at "aiohttp directly" ~300 µs, httpx's default transport
# ~1,900 µs and nginx ~28 µs of CPU per request. This machine's speed moves with its neighbours, so
# they run in the same rounds as the gateway (benchmarks/reference_proxy.py, and nginx's least_conn
# when installed), and the target is also judged as the ratio it stands in to them.
# "bare" is the floor of taogate's own stack (reference_proxy.py --client bare: the gateway's own
# listener and h1 pool, none of the gateway's features), ~100 µs on 2026-12-02 beside nginx's ~45:
# the ≤ 100 µs target is that floor. The Rust routers (vllm-router power_of_two, the SGLang gateway
# cache_aware: the bench extra installs both) were 74 and 100 µs where the target was set; they run
# as references too, so "at their level" is a ratio of one run.
REFERENCE_CPU_US = {
    "aiohttp": 300.0,
    "httpx": 1900.0,
    "nginx": 28.0,
    "bare": 100.0,
    "vllm-router": 74.0,
    "sglang-router": 100.0,
}
# run as many requests as the gateway's phases
CHEAP_REFERENCES = ("nginx", "bare", "vllm-router", "sglang-router")
DEFAULT_REFERENCES = [
    c
    for c in REFERENCE_CPU_US
    if (c != "nginx" or shutil.which("nginx")) and (c not in ROUTER_POLICIES or available(c))
]


# -- load ------------------------------------------------------------------------------------------
@dataclass
class Phase:
    name: str
    requests: int = 0
    errors: int = 0
    error_kinds: dict[str, int] = field(default_factory=dict)
    events: int = 0
    wall: float = 0.0
    latencies: list[float] = field(default_factory=list, repr=False)
    gateway_cpu: float | None = None
    emulator_cpu: float = 0.0
    client_cpu: float = 0.0

    @property
    def others_cpu_us(self) -> float:
        """The emulators' and the load client's CPU per request, µs: what serving the requests cost
        besides the router (its replies' size, its connections, its pace shape them)."""
        return (self.emulator_cpu + self.client_cpu) / max(1, self.requests) * 1e6

    @property
    def rps(self) -> float:
        return self.requests / self.wall

    @property
    def busy_cores(self) -> float:
        """Cores the router, the emulators and the load client kept busy between them."""
        return ((self.gateway_cpu or 0.0) + self.emulator_cpu + self.client_cpu) / self.wall

    def pct(self, q: float) -> float:
        s = sorted(self.latencies)
        return s[min(len(s) - 1, int(q * len(s)))]


def process_cpu() -> float:
    t = os.times()
    return t.user + t.system


async def run_phase(
    http: aiohttp.ClientSession,
    name: str,
    urls: list[str],
    *,
    count: int,
    concurrency: int,
    stream: bool,
    max_tokens: int,
    headers: dict[str, str],
    gateway_pid: int | None,
    emulator_pid: int,
    rate: float | None = None,
) -> Phase:
    """``count`` requests from ``concurrency`` workers, round-robin over ``urls``; with ``rate``,
    request i starts no earlier than i / rate seconds into the phase (open loop, paced)."""
    phase = Phase(name)
    targets = [u + "/v1/completions" for u in urls]
    bodies = [
        json.dumps({"model": MODEL, "prompt": f"hi {i}", "max_tokens": max_tokens, "stream": stream}).encode()
        for i in range(64)
    ]
    hdrs = {"content-type": "application/json", **headers}
    next_i = 0

    async def worker() -> None:
        nonlocal next_i
        while next_i < count:
            i = next_i
            next_i += 1
            if rate is not None:
                await asyncio.sleep(max(0.0, start + i / rate - time.perf_counter()))
            t0 = time.perf_counter()
            try:
                async with http.post(targets[i % len(targets)], data=bodies[i % 64], headers=hdrs) as r:
                    data = await r.read()
                    ok = r.status == 200
            except (aiohttp.ClientError, TimeoutError) as exc:
                ok, data = False, b""
                phase.error_kinds[type(exc).__name__] = phase.error_kinds.get(type(exc).__name__, 0) + 1
            phase.latencies.append(time.perf_counter() - t0)
            if not ok:
                phase.errors += 1
                if data:
                    key = f"HTTP {r.status}"
                    phase.error_kinds[key] = phase.error_kinds.get(key, 0) + 1
            if stream:
                phase.events += data.count(b"data: ")

    g0 = cpu_seconds(gateway_pid) if gateway_pid else 0.0
    e0, c0 = cpu_seconds(emulator_pid), process_cpu()
    t0 = start = time.perf_counter()
    async with asyncio.timeout(PHASE_TIMEOUT_S):
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    phase.wall = time.perf_counter() - t0
    if gateway_pid:
        phase.gateway_cpu = cpu_seconds(gateway_pid) - g0
    phase.emulator_cpu = cpu_seconds(emulator_pid) - e0
    phase.client_cpu = process_cpu() - c0
    phase.requests = count
    return phase


# -- report ----------------------------------------------------------------------------------------
def _label(reference: str) -> str:
    if reference == "bare":
        return "bare listener + h1, no features"
    if reference in ROUTER_POLICIES:
        return f"{reference} {ROUTER_POLICIES[reference]} (Rust)"
    return "nginx least_conn" if reference == "nginx" else f"FastAPI+{reference}"


def cpu_bound_added_ms(router_us: float, others_us: float, direct_us: float, concurrency: int) -> float:
    """The added p50 a closed loop would show if it kept every core of this machine busy: each
    request through the router costs the machine the router's CPU and what it adds to the client's
    and the emulators' (µs), and a CPU-bound closed loop's latency is concurrency × CPU per request
    / cores. What a router adds above it is time no process worked: the convoy of the loop."""
    return concurrency * (router_us + others_us - direct_us) / CORES / 1e3


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


@dataclass
class Round:
    direct: Phase
    gateway: Phase
    gateway_info: Phase | None
    references: dict[str, Phase]
    sdirect: Phase
    sgateway: Phase
    pdirect: Phase
    pgateway: Phase
    concurrency: int

    def figures(self) -> dict[str, float]:
        d, g, sd, sg = self.direct, self.gateway, self.sdirect, self.sgateway
        assert g.gateway_cpu is not None and sg.gateway_cpu is not None
        per_req = g.gateway_cpu / g.requests
        f = {
            "direct_p50_ms": d.pct(0.5) * 1e3,
            "direct_p99_ms": d.pct(0.99) * 1e3,
            "direct_rps": d.rps,
            "gateway_p50_ms": g.pct(0.5) * 1e3,
            "gateway_p99_ms": g.pct(0.99) * 1e3,
            "gateway_rps": g.rps,
            "added_p50_ms": (g.pct(0.5) - d.pct(0.5)) * 1e3,
            "added_p99_ms": (g.pct(0.99) - d.pct(0.99)) * 1e3,
            "rps_ratio": g.rps / d.rps,
            "gateway_cpu_us_per_request": per_req * 1e6,
            "emulator_cpu_us_per_request_direct": d.emulator_cpu / d.requests * 1e6,
            "emulator_cpu_us_per_request_gateway": g.emulator_cpu / g.requests * 1e6,
            "client_cpu_us_per_request_direct": d.client_cpu / d.requests * 1e6,
            "client_cpu_us_per_request_gateway": g.client_cpu / g.requests * 1e6,
            "direct_others_cpu_us_per_request": d.others_cpu_us,
            "others_cpu_us_per_request": g.others_cpu_us,
            "direct_busy_cores": d.busy_cores,
            "busy_cores": g.busy_cores,
            "cpu_bound_added_p50_ms": cpu_bound_added_ms(
                per_req * 1e6, g.others_cpu_us, d.others_cpu_us, self.concurrency
            ),
            "stream_direct_p50_ms": sd.pct(0.5) * 1e3,
            "stream_gateway_p50_ms": sg.pct(0.5) * 1e3,
            "stream_direct_p99_ms": sd.pct(0.99) * 1e3,
            "stream_gateway_p99_ms": sg.pct(0.99) * 1e3,
            "stream_direct_events_per_s": sd.events / sd.wall,
            "stream_gateway_events_per_s": sg.events / sg.wall,
            "stream_gateway_cpu_us_per_stream": sg.gateway_cpu / sg.requests * 1e6,
            "gateway_cpu_us_per_sse_event": (sg.gateway_cpu - sg.requests * per_req)
            / max(1, sg.events)
            * 1e6,
            "events_per_stream": sg.events / sg.requests,
            "paced_direct_p50_ms": self.pdirect.pct(0.5) * 1e3,
            "paced_gateway_p50_ms": self.pgateway.pct(0.5) * 1e3,
            "paced_added_p50_ms": (self.pgateway.pct(0.5) - self.pdirect.pct(0.5)) * 1e3,
            "paced_added_p99_ms": (self.pgateway.pct(0.99) - self.pdirect.pct(0.99)) * 1e3,
        }
        gi = self.gateway_info
        if gi is not None and gi.gateway_cpu is not None:
            f["gateway_info_cpu_us_per_request"] = gi.gateway_cpu / gi.requests * 1e6
            f["gateway_info_p50_ms"] = gi.pct(0.5) * 1e3
            f["gateway_info_rps"] = gi.rps
            f["logging_cost_us_per_request"] = f["gateway_info_cpu_us_per_request"] - per_req * 1e6
            f["gateway_info_added_p50_ms"] = (gi.pct(0.5) - d.pct(0.5)) * 1e3
            f["gateway_info_others_cpu_us_per_request"] = gi.others_cpu_us
            f["gateway_info_busy_cores"] = gi.busy_cores
            f["gateway_info_cpu_bound_added_p50_ms"] = cpu_bound_added_ms(
                f["gateway_info_cpu_us_per_request"], gi.others_cpu_us, d.others_cpu_us, self.concurrency
            )
        shipped = f.get("gateway_info_cpu_us_per_request", per_req * 1e6)  # the default config's
        for client, ref in self.references.items():
            assert ref.gateway_cpu is not None
            ref_cpu = ref.gateway_cpu / ref.requests * 1e6
            f[f"ref_{client}_cpu_us_per_request"] = ref_cpu
            f[f"ref_{client}_vs_then"] = ref_cpu / REFERENCE_CPU_US[client]
            f[f"ref_{client}_added_p50_ms"] = (ref.pct(0.5) - d.pct(0.5)) * 1e3
            f[f"ref_{client}_others_cpu_us_per_request"] = ref.others_cpu_us
            f[f"ref_{client}_busy_cores"] = ref.busy_cores
            f[f"ref_{client}_cpu_bound_added_p50_ms"] = cpu_bound_added_ms(
                ref_cpu, ref.others_cpu_us, d.others_cpu_us, self.concurrency
            )
            f[f"cpu_ratio_to_{client}"] = shipped / ref_cpu
        return f


def summary(med: dict[str, float]) -> None:
    """The side-by-side table: each router's CPU per tiny request, the emulators' and load client's
    beside it (the rest of the cores the closed loop shares), added p50 over direct, the cores the
    loop kept busy, and the added p50 its CPU would allow with every core busy."""
    rows = [
        ("taogate, default config (log info)", "gateway_info_"),
        ("taogate, log warning (no access log)", ""),
        *((f"{_label(client)} (reference)", f"ref_{client}_") for client in REFERENCE_CPU_US),
    ]
    print(
        "| router | CPU per request | emulators + client CPU per request | added p50 over direct "
        f"| cores busy, of {CORES} | added p50 with every core busy |"
    )
    print("|---|---|---|---|---|---|")
    for label, key in rows:
        cpu = f"{key}cpu_us_per_request" if key else "gateway_cpu_us_per_request"
        if cpu in med:
            others = med.get(f"{key}others_cpu_us_per_request", math.nan)
            print(
                f"| {label} | {med[cpu]:,.0f} µs | {others:,.0f} µs | {med[f'{key}added_p50_ms']:.2f} ms "
                f"| {med[f'{key}busy_cores']:.2f} | {med[f'{key}cpu_bound_added_p50_ms']:.2f} ms |"
            )
    print(
        f"| direct (4 emulators) | - | {med['direct_others_cpu_us_per_request']:,.0f} µs "
        f"| p50 {med['direct_p50_ms']:.2f} ms | {med['direct_busy_cores']:.2f} | - |"
    )


def report(rounds: list[Round], args: argparse.Namespace) -> dict[str, Any]:
    figs = [r.figures() for r in rounds]
    med = {k: median([f[k] for f in figs if k in f]) for k in figs[0]}
    errors = {
        p.name: (p.errors, p.error_kinds)
        for r in rounds
        for p in (
            r.direct,
            r.gateway,
            r.gateway_info,
            *r.references.values(),
            r.sdirect,
            r.sgateway,
            r.pdirect,
            r.pgateway,
        )
        if p is not None and p.errors
    }

    def row(label: str, key: str, fmt: str = "{:,.1f}") -> str:
        per = " ".join(fmt.format(f[key]) for f in figs if key in f)
        return f"| {label:<44} | {fmt.format(med[key]):>10} | {per} |"

    print()
    print(
        f"taogate overhead: {args.requests} tiny requests/phase, {args.stream_requests} streams of "
        f"{args.stream_tokens} tokens/phase, {args.concurrency} concurrent, {len(rounds)} rounds "
        f"(median | per round)"
    )
    print(f"| {'figure':<44} | {'median':>10} | per round |")
    print(f"|{'-' * 46}|{'-' * 12}|{'-' * 11}|")
    for label, key, fmt in (
        ("direct p50 latency, ms", "direct_p50_ms", "{:.3f}"),
        ("gateway p50 latency, ms", "gateway_p50_ms", "{:.3f}"),
        ("direct p99 latency, ms", "direct_p99_ms", "{:.3f}"),
        ("gateway p99 latency, ms", "gateway_p99_ms", "{:.3f}"),
        ("direct requests/s", "direct_rps", "{:,.0f}"),
        ("gateway requests/s", "gateway_rps", "{:,.0f}"),
        ("gateway/direct requests/s ratio", "rps_ratio", "{:.3f}"),
        ("gateway CPU µs per request (log warning)", "gateway_cpu_us_per_request", "{:,.0f}"),
        ("gateway CPU µs per request (log info)", "gateway_info_cpu_us_per_request", "{:,.0f}"),
        ("  access-log line cost, µs per request", "logging_cost_us_per_request", "{:,.0f}"),
        ("gateway (log info) requests/s", "gateway_info_rps", "{:,.0f}"),
        *(
            line
            for client, then_us in REFERENCE_CPU_US.items()
            for line in (
                (f"reference {_label(client)} CPU µs/request", f"ref_{client}_cpu_us_per_request", "{:,.0f}"),
                (f"  vs its ~{then_us:,.0f} µs when the target was set", f"ref_{client}_vs_then", "{:.2f}"),
                ("  its added p50 (closed loop), ms", f"ref_{client}_added_p50_ms", "{:.3f}"),
                ("  gateway CPU / this reference's", f"cpu_ratio_to_{client}", "{:.3f}"),
            )
        ),
        ("emulators CPU µs/req (direct | via gateway)", "emulator_cpu_us_per_request_direct", "{:,.0f}"),
        ("  via gateway", "emulator_cpu_us_per_request_gateway", "{:,.0f}"),
        ("load client CPU µs/req, direct", "client_cpu_us_per_request_direct", "{:,.0f}"),
        ("  via gateway", "client_cpu_us_per_request_gateway", "{:,.0f}"),
        ("stream direct p50, ms", "stream_direct_p50_ms", "{:.3f}"),
        ("stream gateway p50, ms", "stream_gateway_p50_ms", "{:.3f}"),
        ("stream direct SSE events/s", "stream_direct_events_per_s", "{:,.0f}"),
        ("stream gateway SSE events/s", "stream_gateway_events_per_s", "{:,.0f}"),
        ("SSE events per stream (data: lines)", "events_per_stream", "{:.0f}"),
        ("gateway CPU µs per stream (whole)", "stream_gateway_cpu_us_per_stream", "{:,.0f}"),
        (f"paced {args.paced_rate:g} req/s: direct p50, ms", "paced_direct_p50_ms", "{:.3f}"),
        (f"paced {args.paced_rate:g} req/s: gateway p50, ms", "paced_gateway_p50_ms", "{:.3f}"),
        ("paced: added p50, ms", "paced_added_p50_ms", "{:.3f}"),
        ("paced: added p99, ms", "paced_added_p99_ms", "{:.3f}"),
    ):
        if key in med:
            print(row(label, key, fmt))
    print()
    summary(med)
    print()
    checks = [
        (
            "gateway CPU per proxied request",
            med.get("gateway_info_cpu_us_per_request", med["gateway_cpu_us_per_request"]),
            TARGET_CPU_PER_REQUEST_US,
            "µs",
        ),
        *(
            (
                f"  as a ratio to {_label(client)} (run)",
                med[f"cpu_ratio_to_{client}"],
                round(TARGET_CPU_PER_REQUEST_US / then_us, 2),
                "x",
            )
            for client, then_us in REFERENCE_CPU_US.items()
            if f"cpu_ratio_to_{client}" in med
        ),
        (
            "gateway CPU per relayed SSE event",
            med["gateway_cpu_us_per_sse_event"],
            TARGET_CPU_PER_EVENT_US,
            "µs",
        ),
        (
            f"added p50 at {args.concurrency} concurrent (closed loop)",
            med.get("gateway_info_added_p50_ms", med["added_p50_ms"]),
            TARGET_ADDED_P50_MS,
            "ms",
        ),
        (
            f"added p50, paced (≤ {args.concurrency} in flight)",
            med["paced_added_p50_ms"],
            TARGET_ADDED_P50_MS,
            "ms",
        ),
    ]
    print(f"| {'check':<40} | {'target':>10} | {'measured':>10} | {'':4} |")
    print(f"|{'-' * 42}|{'-' * 12}|{'-' * 12}|{'-' * 6}|")
    verdicts = {}
    for label, value, target, unit in checks:
        ok = value <= target
        verdicts[label] = {"target": target, "measured": value, "unit": unit, "pass": ok}
        t, v = f"≤ {target:g} {unit}", f"{value:,.2f} {unit}"
        print(f"| {label:<40} | {t:>10} | {v:>10} | {'PASS' if ok else 'FAIL'} |")
    print(
        f"(added p99: {med['added_p99_ms']:.3f} ms; per-round added p50: "
        + ", ".join(f"{f['added_p50_ms']:.3f}" for f in figs)
        + " ms; per-round SSE µs/event: "
        + ", ".join(f"{f['gateway_cpu_us_per_sse_event']:.2f}" for f in figs)
        + f"; paced at {args.paced_rate:g} req/s, added p50 {med['paced_added_p50_ms']:.3f} ms,"
        + f" p99 {med['paced_added_p99_ms']:.3f} ms)"
    )
    info = "gateway_info_" if "gateway_info_busy_cores" in med else ""
    print(
        f"(closed loop: with every core busy, the default config's CPU would add "
        f"{med[f'{info}cpu_bound_added_p50_ms']:.2f} ms; the loop kept {med[f'{info}busy_cores']:.2f} of "
        f"{CORES} cores busy, direct {med['direct_busy_cores']:.2f})"
    )
    if errors:
        print(f"NON-200 / FAILED REQUESTS: {errors}")
    return {"args": vars(args), "median": med, "rounds": figs, "targets": verdicts, "errors": errors}


# -- main ------------------------------------------------------------------------------------------
def precise_config(workdir: Path, instances: int) -> tuple[str, list[str]]:
    """Precise prefix-cache dispatch for the main gateway: a local tokenizer (each prompt's token ids
    and block hashes) and a KV-events subscriber per instance (the instant emulators publish none)."""
    import tokenizers

    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({"[UNK]": 0, "hi": 1}, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    path = workdir / "tokenizer.json"
    tok.save(str(path))
    extra = f'[prefill]\ntokenizer = "{path}"\n'
    return extra, [f'kv_events = "tcp://127.0.0.1:{free_port()}"\n' for _ in range(instances)]


async def bench(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    async with contextlib.AsyncExitStack() as stack:
        emu = await stack.enter_async_context(emulators(4, workdir / "emulators.log"))
        urls = emu.urls
        extra, per_instance = precise_config(workdir, len(urls)) if args.precise else ("", [])
        gw = await stack.enter_async_context(
            gateway(workdir, urls, "warning", API_KEY, extra, instance_extra=per_instance)
        )
        gw_url = gw.url
        gwi: Child | None = None
        gwi_url = None
        if not args.skip_info:
            gwi = await stack.enter_async_context(gateway(workdir, urls, "info", API_KEY))
            gwi_url = gwi.url
        refs: dict[str, tuple[Child, str]] = {}
        for client in args.references:
            ref = await stack.enter_async_context(reference(workdir, urls, client))
            refs[client] = (ref, ref.url)
        print(f"emulators: {' '.join(urls)} (pid {emu.pid})")
        print(
            f"gateway:   {gw_url} (pid {gw.pid})"
            + (f", log-info gateway {gwi_url} (pid {gwi.pid})" if gwi else "")
        )

        auth = {"authorization": f"Bearer {API_KEY}"}
        # keepalive under uvicorn's 5 s: never reuse a connection the gateway is closing right then
        conn = aiohttp.TCPConnector(limit=args.concurrency * 2, limit_per_host=0, keepalive_timeout=3)
        timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
        async with aiohttp.ClientSession(connector=conn, timeout=timeout) as http:
            common: dict[str, Any] = {"concurrency": args.concurrency, "emulator_pid": emu.pid}

            async def tiny(
                name: str,
                target: list[str],
                pid: int | None,
                hdrs: dict[str, str],
                n: int,
                rate: float | None = None,
            ) -> Phase:
                return await run_phase(
                    http,
                    name,
                    target,
                    count=n,
                    stream=False,
                    max_tokens=1,
                    headers=hdrs,
                    gateway_pid=pid,
                    rate=rate,
                    **common,
                )

            async def paced(name: str, target: list[str], pid: int | None, hdrs: dict[str, str]) -> Phase:
                n = max(1, int(args.paced_rate * args.paced_seconds))
                return await tiny(name, target, pid, hdrs, n, rate=args.paced_rate)

            async def streams(name: str, target: list[str], pid: int | None, hdrs: dict[str, str]) -> Phase:
                return await run_phase(
                    http,
                    name,
                    target,
                    count=args.stream_requests,
                    stream=True,
                    max_tokens=args.stream_tokens,
                    headers=hdrs,
                    gateway_pid=pid,
                    **common,
                )

            # Warm-up: connections pooled everywhere, code paths and allocator warm.
            warm = max(200, args.requests // 10)
            await tiny("warm-direct", urls, None, {}, warm)
            await tiny("warm-gateway", [gw_url], gw.pid, auth, warm)
            if gwi is not None:
                assert gwi_url is not None
                await tiny("warm-gateway-info", [gwi_url], gwi.pid, auth, warm)
            for client, (proc, url) in refs.items():
                await tiny(
                    f"warm-reference-{client}", [url], proc.pid, {}, min(warm, args.reference_requests)
                )

            # Background work (health probes, /metrics scrapes) costs CPU with no traffic at all; it is
            # inside every phase's Δcpu, so show it: at R requests/s it adds (idle / R) per request.
            g0 = cpu_seconds(gw.pid)
            await asyncio.sleep(IDLE_WINDOW_S)
            idle_ms_per_s = (cpu_seconds(gw.pid) - g0) / IDLE_WINDOW_S * 1e3
            print(f"gateway idle CPU (probes + scrapes): {idle_ms_per_s:.1f} ms/s", flush=True)

            rounds: list[Round] = []
            for n in range(args.rounds):
                d = await tiny("direct", urls, None, {}, args.requests)
                g = await tiny("gateway", [gw_url], gw.pid, auth, args.requests)
                gi = None
                if gwi is not None:
                    assert gwi_url is not None
                    gi = await tiny("gateway-info", [gwi_url], gwi.pid, auth, args.requests)
                rp = {  # nginx is as fast as the emulators: a full phase, for the CPU counters' 10 ms ticks
                    client: await tiny(
                        f"reference-{client}",
                        [url],
                        proc.pid,
                        {},
                        args.requests if client in CHEAP_REFERENCES else args.reference_requests,
                    )
                    for client, (proc, url) in refs.items()
                }
                sd = await streams("stream-direct", urls, None, {})
                sg = await streams("stream-gateway", [gw_url], gw.pid, auth)
                pd = await paced("paced-direct", urls, None, {})
                pg = await paced("paced-gateway", [gw_url], gw.pid, auth)
                rounds.append(Round(d, g, gi, rp, sd, sg, pd, pg, args.concurrency))
                f = rounds[-1].figures()
                print(
                    f"round {n + 1}/{args.rounds}: direct p50 {f['direct_p50_ms']:.3f} ms "
                    f"{f['direct_rps']:,.0f} rps | gateway p50 {f['gateway_p50_ms']:.3f} ms "
                    f"{f['gateway_rps']:,.0f} rps, {f['gateway_cpu_us_per_request']:,.0f} µs CPU/req"
                    + (
                        f" (info log {f['gateway_info_cpu_us_per_request']:,.0f})"
                        if "gateway_info_cpu_us_per_request" in f
                        else ""
                    )
                    + "".join(f" ({_label(c)} {f[f'ref_{c}_cpu_us_per_request']:,.0f})" for c in refs)
                    + f" | SSE {f['gateway_cpu_us_per_sse_event']:.2f} µs CPU/event"
                    + f" | paced added p50 {f['paced_added_p50_ms']:.3f} ms",
                    flush=True,
                )
        result = report(rounds, args)
        result["gateway_idle_cpu_ms_per_s"] = idle_ms_per_s
        print(
            f"gateway idle CPU {idle_ms_per_s:.1f} ms/s (probes + scrapes) is included above: "
            f"~{idle_ms_per_s * 1e3 / result['median']['gateway_rps']:.0f} µs/request at its rate"
        )
        return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--requests", type=int, default=4000, help="tiny requests per phase (default 4000)")
    p.add_argument("--concurrency", type=int, default=32, help="concurrent workers (default 32)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds; medians reported (default 3)")
    p.add_argument("--stream-tokens", type=int, default=200, help="max_tokens of each stream (default 200)")
    p.add_argument("--stream-requests", type=int, default=1000, help="streams per phase (default 1000)")
    p.add_argument(
        "--paced-rate", type=float, default=200.0, help="open-loop phase: requests/s (default 200)"
    )
    p.add_argument("--paced-seconds", type=float, default=5.0, help="open-loop phase length (default 5)")
    p.add_argument("--skip-info", action="store_true", help="skip the log_level=info gateway phase")
    p.add_argument(
        "--precise",
        action="store_true",
        help="the main gateway in precise prefix-cache mode (a tokenizer, KV-event subscribers)",
    )
    p.add_argument(
        "--references",
        type=lambda v: [c for c in v.split(",") if c],
        default=DEFAULT_REFERENCES,
        help="reference proxies to run beside the gateway, comma-separated "
        "(default aiohttp,httpx,bare, and nginx, vllm-router and sglang-router when installed; '' "
        "for none): they calibrate the CPU target on a shared machine",
    )
    p.add_argument(
        "--reference-requests",
        type=int,
        default=1000,
        help="tiny requests per FastAPI reference phase (default 1000: httpx's costs ~4 ms of CPU each "
        "here); nginx gets --requests",
    )
    p.add_argument("--json", type=Path, default=None, help="also write the figures as JSON here")
    args = p.parse_args()
    unknown = set(args.references) - set(REFERENCE_CPU_US)
    if unknown:
        p.error(f"unknown reference(s) {sorted(unknown)}; choose from {sorted(REFERENCE_CPU_US)}")
    if not (1 <= args.requests <= 200_000 and 1 <= args.concurrency <= 1024 and 1 <= args.rounds <= 20):
        p.error("--requests 1..200000, --concurrency 1..1024, --rounds 1..20")
    if not 1 <= args.reference_requests <= 200_000:
        p.error("--reference-requests 1..200000")
    if not (1 <= args.paced_rate <= 20_000 and 0.5 <= args.paced_seconds <= 120):
        p.error("--paced-rate 1..20000, --paced-seconds 0.5..120")
    if not (1 <= args.stream_tokens <= 4096 and 1 <= args.stream_requests <= 50_000):
        p.error("--stream-tokens 1..4096, --stream-requests 1..50000")
    try:
        import uvloop

        runner: Any = uvloop.run
    except ImportError:
        runner = asyncio.run
    with tempfile.TemporaryDirectory(prefix="taogate-overhead-") as tmp:
        result = runner(bench(args, Path(tmp)))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2, default=str))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
