"""Picker mode against ``taogate serve`` and against Envoy alone, on emulated fleets.

Three sections, each row on a fresh fleet, every server in a process of its own on 127.0.0.1:

``cells``     the dispatch matrix's quick cells (``taogate.bench.matrix.QUICK``), rows: serve with
              least_requests; serve default; Envoy + ``taogate pick`` default; Envoy alone
              round robin; Envoy alone least_request. Throughput, p50/p99 latency, hit rate (the
              emulators' own books), and the front's CPU per request (serve's process; the picker's
              and Envoy's apart).
``overhead``  instant emulators: tiny requests one at a time (p50: what the picker adds to Envoy
              alone, what serve adds to a direct call), then a closed loop of 16 for CPU per request.
``pickers``   precise mode (each picker indexes every instance's KV events): one picker against two
              behind one Envoy, on a shared-prefix workload of token-id prompts (hit rate).

    .venv/bin/python benchmarks/picker.py                       # all three, minutes
    .venv/bin/python benchmarks/picker.py --sections overhead pickers
    .venv/bin/python benchmarks/picker.py --cells "8 hot, half cache" "long-prompts"
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import secrets
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx
import tomli_w
import yaml

from taogate.bench import matrix
from taogate.bench.isolated import fleet_process, fleet_stats, gateway_process
from taogate.bench.matrix import Cell
from taogate.bench.procs import Child, cpu_seconds, free_port, launch
from taogate.bench.report import summarize
from taogate.bench.runner import Target, run_load
from taogate.bench.scenarios import Scenario, gateway_settings
from taogate.bench.workloads import RequestSpec, Workload
from taogate.config_files import redacted_dump
from taogate.emulator.config import EmulatorConfig
from taogate.serving import loop_factory
from taogate.settings import Settings

for _name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
    os.environ.pop(_name, None)

ROOT = Path(__file__).resolve().parent.parent
BOOTSTRAP = ROOT / "deploy" / "envoy" / "envoy.yaml"
BIN = Path(sys.executable).parent
KEY = secrets.token_urlsafe(16)
DEFAULT = Scenario("default", "gateway", "least_busy", prefix_affinity=True)
LEAST_REQUESTS = Scenario("least_requests", "gateway", "least_requests")


# -- the fronts ---------------------------------------------------------------------------------
@dataclass(slots=True)
class Front:
    """Where the load goes, and the processes whose CPU is the front's."""

    url: str
    pids: dict[str, int]


def _bootstrap(listen: int, admin: int, pickers: Sequence[int], fleet: Sequence[str], lb: str | None) -> str:
    """The shipped bootstrap on these ports; ``lb``: Envoy alone, balancing over ``fleet`` itself."""
    doc: dict[str, Any] = yaml.safe_load(BOOTSTRAP.read_text())
    doc["admin"]["address"]["socket_address"]["port_value"] = admin
    listener = doc["static_resources"]["listeners"][0]
    listener["address"]["socket_address"] = {"address": "127.0.0.1", "port_value": listen}
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    clusters = doc["static_resources"]["clusters"]

    def endpoints(ports: Sequence[int]) -> list[dict[str, Any]]:
        sock = [{"address": "127.0.0.1", "port_value": p} for p in ports]
        return [{"endpoint": {"address": {"socket_address": s}}} for s in sock]

    picker = next(c for c in clusters if c["name"] == "taogate_picker")
    picker["load_assignment"]["endpoints"][0]["lb_endpoints"] = endpoints(pickers)
    if lb is not None:
        hcm["http_filters"] = hcm["http_filters"][1:]  # no ext_proc
        hcm["route_config"]["virtual_hosts"][0]["routes"][0]["route"]["cluster"] = "fleet"
        ports = [int(u.rsplit(":", 1)[1]) for u in fleet]
        clusters[:] = [
            {
                "name": "fleet",
                "type": "STATIC",
                "lb_policy": lb,
                "connect_timeout": "5s",
                "circuit_breakers": clusters[0]["circuit_breakers"],
                "load_assignment": {
                    "cluster_name": "fleet",
                    "endpoints": [{"lb_endpoints": endpoints(ports)}],
                },
            }
        ]
    return str(yaml.safe_dump(doc))


@contextlib.asynccontextmanager
async def envoy(
    workdir: Path, fleet: Sequence[str], pickers: Sequence[int] = (), lb: str | None = None
) -> AsyncIterator[Child]:
    listen, admin = free_port(), free_port()
    path = workdir / f"envoy-{listen}.yaml"
    path.write_text(_bootstrap(listen, admin, pickers, fleet, lb))
    cmd = [str(BIN / "envoy"), "-c", str(path), "--log-level", "error", "--concurrency", "1"]
    cmd += ["--base-id", str(listen)]
    async with launch(
        cmd,
        name="envoy",
        log=workdir / "envoy.log",
        ready_url=f"http://127.0.0.1:{admin}",
        ready_paths=("/ready",),
    ) as child:
        child.urls[:] = [f"http://127.0.0.1:{listen}"]
        yield child


@contextlib.asynccontextmanager
async def picker(workdir: Path, settings: Settings) -> AsyncIterator[tuple[Child, int]]:
    """``taogate pick`` with ``settings`` (written as config.toml), ready once its fleet is probed."""
    config = workdir / f"picker-{secrets.token_hex(4)}.toml"
    data = redacted_dump(settings)
    data["gateway"]["log_level"] = "warning"
    config.write_text(tomli_w.dumps(data))
    port, http = free_port(), free_port()
    cmd = [str(BIN / "taogate"), "pick", "-c", str(config), "--port", str(port), "--http-port", str(http)]
    env = {**os.environ, settings.gateway.api_key_env: KEY}
    async with launch(
        cmd,
        name="picker",
        log=workdir / "picker.log",
        env=env,
        ready_prefix="picker ready ",
        ready_url=f"http://127.0.0.1:{http}",
        ready_paths=("/health", "/ready"),
    ) as child:
        yield child, port


@contextlib.asynccontextmanager
async def front(
    kind: str, workdir: Path, urls: Sequence[str], settings: Settings, pickers: int = 1
) -> AsyncIterator[Front]:
    """``serve``, ``picker`` (Envoy + ``pickers`` pickers), or Envoy alone (``ROUND_ROBIN``...)."""
    async with contextlib.AsyncExitStack() as stack:
        if kind == "serve":
            pids: list[int] = []
            url = await stack.enter_async_context(gateway_process(settings, KEY, pids.append))
            yield Front(url, {"serve": pids[0]})
        elif kind == "picker":
            found = [await stack.enter_async_context(picker(workdir, settings)) for _ in range(pickers)]
            ev = await stack.enter_async_context(envoy(workdir, urls, [p for _, p in found]))
            yield Front(ev.url, {**{f"picker{n}": c.pid for n, (c, _) in enumerate(found)}, "envoy": ev.pid})
        else:
            ev = await stack.enter_async_context(envoy(workdir, urls, lb=kind))
            yield Front(ev.url, {"envoy": ev.pid})


def _cpu(pids: dict[str, int]) -> dict[str, float]:
    return {name: cpu_seconds(pid) for name, pid in pids.items()}


def _hit(stats: list[dict[str, Any]]) -> float:
    prompt = sum(int(s.get("prompt_tokens", 0)) for s in stats)
    return sum(int(s.get("cached_tokens", 0)) for s in stats) / prompt if prompt else float("nan")


# -- cells ----------------------------------------------------------------------------------------
ROWS = (
    ("serve least_requests", "serve", LEAST_REQUESTS),
    ("serve default", "serve", DEFAULT),
    ("envoy + picker", "picker", DEFAULT),
    ("envoy round robin", "ROUND_ROBIN", DEFAULT),
    ("envoy least_request", "LEAST_REQUEST", DEFAULT),
)


async def cell_rows(cell: Cell, workdir: Path) -> list[dict[str, Any]]:
    configs = matrix.configs(cell)
    work = matrix.workload(cell)
    out = []
    for label, kind, scenario in ROWS:
        async with fleet_process(configs) as urls:
            names = [f"i{n}" for n in range(len(urls))]
            settings = gateway_settings(urls, scenario, names=names)
            async with front(kind, workdir, urls, settings) as f:
                before = _cpu(f.pids)
                run = await run_load([Target(f.url + "/v1", KEY)], work, configs[0].model, label=label)
                after = _cpu(f.pids)
            stats = await fleet_stats(urls)
        s = summarize(label, run.samples, names)
        ok = max(1, s.ok)
        cpu = {k: 1000 * (after[k] - before[k]) / ok for k in f.pids}
        out.append(
            {
                "row": label,
                "ok": s.ok,
                "errors": sum(s.errors.values()),
                "rps": s.requests_per_s,
                "p50": s.latency.p50,
                "p99": s.latency.p99,
                "hit": _hit(stats),
                "cpu_ms": cpu,
            }
        )
        print(_line(out[-1]), flush=True)
    return out


def _line(r: dict[str, Any]) -> str:
    cpu = " ".join(f"{k} {v:.2f}" for k, v in r["cpu_ms"].items())
    return (
        f"  {r['row']:<22} ok {r['ok']:>4} err {r['errors']:>3}  {r['rps']:6.2f} req/s  p50 {r['p50']:6.3f}s"
        f"  p99 {r['p99']:6.3f}s  hit {r['hit']:.3f}  cpu ms/req: {cpu}"
    )


# -- overhead -------------------------------------------------------------------------------------
def _tiny(n: int, concurrency: int) -> Workload:
    return Workload("tiny", tuple(RequestSpec(i, "hi", 1) for i in range(n)), concurrency)


async def overhead(workdir: Path, sequential: int, loaded: int) -> list[dict[str, Any]]:
    configs = [EmulatorConfig(instant=True, seed=i) for i in range(4)]
    out: list[dict[str, Any]] = []
    async with fleet_process(configs) as urls:
        settings = gateway_settings(urls, DEFAULT, names=[f"i{n}" for n in range(4)])
        direct = await run_load([Target(urls[0] + "/v1", "", "i0")], _tiny(sequential, 1), configs[0].model)
        out.append({"row": "direct", "p50": summarize("direct", direct.samples).latency.p50, "cpu_ms": {}})
        for label, kind in (
            ("serve", "serve"),
            ("envoy + picker", "picker"),
            ("envoy alone", "LEAST_REQUEST"),
        ):
            async with front(kind, workdir, urls, settings) as f:
                one = await run_load([Target(f.url + "/v1", KEY)], _tiny(sequential, 1), configs[0].model)
                before = _cpu(f.pids)
                busy = await run_load([Target(f.url + "/v1", KEY)], _tiny(loaded, 16), configs[0].model)
                after = _cpu(f.pids)
            s = summarize(label, busy.samples)
            out.append(
                {
                    "row": label,
                    "p50": summarize(label, one.samples).latency.p50,
                    "rps": s.requests_per_s,
                    "errors": sum(s.errors.values()),
                    "cpu_ms": {k: 1000 * (after[k] - before[k]) / max(1, s.ok) for k in f.pids},
                }
            )
            print(f"  {label:<16} p50 {out[-1]['p50'] * 1000:7.2f} ms  {out[-1]['cpu_ms']}", flush=True)
    return out


# -- several pickers ------------------------------------------------------------------------------
PREFIXES, PREFIX_TOKENS, CONCURRENCY = 8, 640, 12


async def _token_load(url: str, model: str, requests: int) -> int:
    """A closed loop of completions whose prompts are token ids: 8 hot prefixes, unique suffixes."""
    rng = random.Random(7)
    prefixes = [[10_000 + 1000 * k + i for i in range(PREFIX_TOKENS)] for k in range(PREFIXES)]
    prompts = [
        [*prefixes[rng.randrange(PREFIXES)], *(rng.randrange(3, 9000) for _ in range(24))]
        for _ in range(requests)
    ]
    slots = asyncio.Semaphore(CONCURRENCY)
    ok = 0
    async with httpx.AsyncClient(
        timeout=120, trust_env=False, headers={"authorization": f"Bearer {KEY}"}
    ) as http:

        async def one(prompt: list[int]) -> None:
            nonlocal ok
            async with slots:
                r = await http.post(
                    url + "/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 8}
                )
                ok += r.status_code == 200

        await asyncio.gather(*(one(p) for p in prompts))
    return ok


def _tokenizer(workdir: Path) -> Path:
    """Any tokenizer.json: the prompts are token ids, which pass through as they are."""
    import tokenizers

    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({"[UNK]": 0, "hi": 1}, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    path = workdir / "tokenizer.json"
    tok.save(str(path))
    return path


async def pickers(workdir: Path, rounds: int, requests: int) -> list[dict[str, Any]]:
    # A cache holding about half the hot prefixes per instance: where each prompt goes matters. Each
    # engine binds its KV-events socket (a wildcard endpoint, as vLLM does for one): every picker
    # connects to it. (To a loopback endpoint vLLM connects, and only one subscriber can bind it.)
    blocks = 1 + (PREFIXES // 2) * (PREFIX_TOKENS // 16 + 2) + 4 * 4
    out = []
    for rnd in range(rounds):
        for count in (1, 2) if rnd % 2 == 0 else (2, 1):
            endpoints = [f"tcp://*:{free_port()}" for _ in range(4)]
            configs = [
                EmulatorConfig(
                    seed=i,
                    enable_prefix_caching=True,
                    enable_prompt_tokens_details=True,
                    num_gpu_blocks_override=blocks,
                    kv_events_endpoint=e,
                )
                for i, e in enumerate(endpoints)
            ]
            async with fleet_process(configs) as urls:
                settings = gateway_settings(urls, DEFAULT, names=[f"i{n}" for n in range(4)])
                settings = settings.model_copy(
                    update={
                        "prefill": settings.prefill.model_copy(update={"tokenizer": str(_tokenizer(workdir))})
                    }
                )
                for item, endpoint in zip(settings.instances, endpoints, strict=True):
                    item.kv_events = endpoint
                async with front("picker", workdir, urls, settings, pickers=count) as f:
                    await asyncio.sleep(1.0)  # the subscriptions through (ZMQ's slow joiner)
                    started = time.monotonic()
                    ok = await _token_load(f.url, configs[0].model, requests)
                    span = time.monotonic() - started
                stats = await fleet_stats(urls)
            out.append({"pickers": count, "ok": ok, "rps": ok / span, "hit": _hit(stats)})
            print(
                f"  {count} picker(s): ok {ok}/{requests}  {ok / span:6.2f} req/s  hit {out[-1]['hit']:.3f}",
                flush=True,
            )
    return out


# -- main -----------------------------------------------------------------------------------------
async def main(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory(prefix="taogate-picker-bench-") as tmp:
        workdir = Path(tmp)
        if "overhead" in args.sections:
            print("overhead (instant emulators):", flush=True)
            rows = await overhead(workdir, args.sequential, args.loaded)
            by = {r["row"]: r for r in rows}
            serve_cpu = by["serve"]["cpu_ms"]["serve"]
            pick_cpu = sum(v for k, v in by["envoy + picker"]["cpu_ms"].items() if k.startswith("picker"))
            envoy_cpu = by["envoy + picker"]["cpu_ms"]["envoy"]
            print(
                f"  picker CPU per request / serve's: {pick_cpu / serve_cpu:.2f}"
                f" ({pick_cpu:.3f} vs {serve_cpu:.3f} ms; Envoy's own {envoy_cpu:.3f} ms)"
            )
            added = (by["envoy + picker"]["p50"] - by["envoy alone"]["p50"]) * 1000
            served = (by["serve"]["p50"] - by["direct"]["p50"]) * 1000
            print(
                f"  p50 added: picker to Envoy alone {added:.2f} ms; serve to a direct call {served:.2f} ms"
            )
        if "cells" in args.sections:
            chosen = [c for c in matrix.QUICK if not args.cells or c.name in args.cells]
            for chosen_cell in chosen:
                cell = chosen_cell
                if args.max_requests:
                    cell = replace(cell, requests=min(cell.requests, args.max_requests))
                print(f"cell {cell.name}: {cell.describe()}", flush=True)
                rows = await cell_rows(cell, workdir)
                by = {r["row"]: r for r in rows}
                pk, sv = by["envoy + picker"], by["serve default"]
                print(
                    f"  picker/serve: rps {pk['rps'] / sv['rps']:.2f}  p99 {pk['p99'] / sv['p99']:.2f}"
                    f"  hit {pk['hit'] - sv['hit']:+.3f};  serve/least_requests rps"
                    f" {sv['rps'] / by['serve least_requests']['rps']:.2f};  picker/envoy least_request rps"
                    f" {pk['rps'] / by['envoy least_request']['rps']:.2f} p99"
                    f" {pk['p99'] / by['envoy least_request']['p99']:.2f}",
                    flush=True,
                )
        if "pickers" in args.sections:
            print("pickers (precise mode, token-id prompts sharing 8 prefixes):", flush=True)
            rows = await pickers(workdir, args.rounds, args.pick_requests)
            one = statistics.mean(r["hit"] for r in rows if r["pickers"] == 1)
            two = statistics.mean(r["hit"] for r in rows if r["pickers"] == 2)
            print(f"  hit rate, two pickers / one: {two / one:.3f} ({two:.3f} vs {one:.3f})")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--sections",
        nargs="+",
        choices=("overhead", "cells", "pickers"),
        default=["overhead", "cells", "pickers"],
    )
    parser.add_argument("--cells", nargs="*", default=[], help="quick cells by name (default: all)")
    parser.add_argument(
        "--max-requests", type=int, default=0, help="cap each cell's requests (0: as the matrix)"
    )
    parser.add_argument("--sequential", type=int, default=300, help="overhead: tiny requests one at a time")
    parser.add_argument("--loaded", type=int, default=2000, help="overhead: tiny requests, 16 at a time")
    parser.add_argument("--rounds", type=int, default=2, help="pickers: rounds of one-then-two (alternating)")
    parser.add_argument("--pick-requests", type=int, default=480, help="pickers: requests per run")
    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        runner.run(main(parser.parse_args()))
