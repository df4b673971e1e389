"""The gateway's instructions per proxied request, counted by callgrind: configurations side by side.

Timed CPU on this shared machine moves more between rounds than the few percent a change costs
(benchmarks/README.md, overhead.py); instructions do not. Each run starts 4 instant emulators and
``taogate serve`` under ``valgrind --tool=callgrind`` with instrumentation off, warms the gateway
up, turns instrumentation on for ``--requests`` requests (32 at a time), off again, and divides the
instructions by the requests. Scrapes and health probes are set far apart, and the gateway's other
timers (history frames, the access log's flushes, uvicorn's ticks) cost instructions per second
whatever the load: under callgrind a window lasts 30 s or 150 s as the machine's neighbours allow,
which moved the raw figure by 15%. So an idle window of ``IDLE_S`` follows, and its rate times the
load window's length is subtracted: the net figure is the request path's.

Configurations (``--configs``): ``default`` (as shipped: metrics and the access log at ``info``),
``quiet`` (``log_level = "warning"``: no access log), and ``precise`` (the default with a local
tokenizer and a KV-events subscriber per instance, as overhead.py's ``--precise``; the instant
emulators publish no events); ``bare``, the floor of this stack: ``reference_proxy.py --client
bare``, the gateway's own listener and ``h1`` pool forwarding with none of the gateway's
features; ``raw``, the same forwarding on an httptools protocol without uvicorn or ASGI.
``--keep DIR`` keeps callgrind's output files for ``callgrind_annotate``.
Prompts (``--prompt``): ``tiny`` (``"hi <n>"`` completions, overhead.py's load) or ``chat`` (a
shared ~1,100-character system prompt and a short question: a prefix key per request). Rounds
alternate the configurations.

    flock /tmp/taogate-heavy.lock .venv/bin/python benchmarks/instructions.py [--requests 2000] \\
        [--rounds 2] [--configs default quiet precise] [--prompt tiny] [--keep DIR]

Needs valgrind (``callgrind_control`` with it); each configuration of a round takes a minute or two.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import aiohttp
from fleetprocs import emulators, gateway, reference
from overhead import API_KEY, MODEL, precise_config

CONCURRENCY = 32
WARMUP = 200
IDLE_S = 20.0  # the idle window after the load, whose rate is subtracted from it
QUIET = "[dispatch]\nscrape_interval = 600\nhealth_check_interval = 600\n"
SYSTEM = "You are a careful assistant who answers in one sentence. " * 20


def _body(prompt: str) -> tuple[str, Callable[[int], bytes]]:
    if prompt == "tiny":
        return "/v1/completions", lambda i: json.dumps(
            {"model": MODEL, "prompt": f"hi {i}", "max_tokens": 1}
        ).encode()
    return "/v1/chat/completions", lambda i: json.dumps(
        {
            "model": MODEL,
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"question {i}"}],
            "max_tokens": 1,
        }
    ).encode()


async def _load(url: str, count: int, body: Callable[[int], bytes]) -> None:
    headers = {"authorization": f"Bearer {API_KEY}", "content-type": "application/json"}
    todo = iter(range(count))
    async with aiohttp.ClientSession() as http:

        async def worker() -> None:
            for i in todo:
                async with http.post(url, data=body(i), headers=headers) as r:
                    text = await r.text()
                    if r.status != 200:
                        raise RuntimeError(f"{r.status}: {text[:200]}")

        await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))


def _callgrind(*args: str) -> None:
    subprocess.run(["callgrind_control", *args], check=True, capture_output=True)


def _dumps(workdir: Path) -> dict[int, int]:
    """Each dump's instructions by its number (callgrind writes ``callgrind.out.N`` per dump)."""
    out = {}
    for path in workdir.glob("callgrind.out.*"):
        totals = [line for line in path.read_text().splitlines() if line.startswith("totals:")]
        if totals:
            out[int(path.suffix[1:])] = int(totals[-1].split()[1])
    return out


def _keep(workdir: Path, keep: Path, config: str) -> None:
    keep.mkdir(parents=True, exist_ok=True)
    for path in workdir.glob("callgrind.out*"):
        shutil.copy(path, keep / f"{config}-{path.name}")


async def count(config: str, prompt: str, requests: int, keep: Path | None) -> tuple[float, float, float]:
    """(instructions per request, idle instructions per second, seconds the window took)."""
    with tempfile.TemporaryDirectory(prefix="taogate-instr-") as tmp:
        workdir = Path(tmp)
        async with emulators(4, workdir / "emulators.log") as emu:
            extra, per_instance = precise_config(workdir, 4) if config == "precise" else ("", [])
            callgrind = [
                "valgrind",
                "--tool=callgrind",
                "--instr-atstart=no",
                f"--callgrind-out-file={workdir / 'callgrind.out'}",
            ]
            route, body = _body(prompt)
            server = (
                reference(workdir, emu.urls, config, wrapper=callgrind)
                if config in ("bare", "raw")
                else gateway(
                    workdir,
                    emu.urls,
                    "warning" if config == "quiet" else "info",
                    API_KEY,
                    QUIET + extra,
                    instance_extra=per_instance,
                    wrapper=callgrind,
                    ready_within=600,
                )
            )
            async with server as gw:
                url = gw.url + route
                await _load(url, WARMUP, body)
                pid = str(gw.pid)
                _callgrind("--instr=on", pid)
                started = time.monotonic()
                await _load(url, requests, body)
                seconds = time.monotonic() - started
                _callgrind("--instr=off", pid)
                _callgrind("--dump", pid)
                _callgrind("--instr=on", pid)  # the same timers with no load, to subtract
                await asyncio.sleep(IDLE_S)
                _callgrind("--instr=off", pid)
                _callgrind("--dump", pid)
        if keep is not None:
            _keep(workdir, keep, config)
        dumps = _dumps(workdir)
        return dumps[1] / requests, dumps[2] / IDLE_S, seconds


async def main(args: argparse.Namespace) -> int:
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        print("needs valgrind (apt-get install valgrind)")
        return 2
    results: dict[str, list[float]] = {c: [] for c in args.configs}
    print(f"gateway instructions per request, {args.prompt} prompts, {args.requests} requests a window")
    for n in range(1, args.rounds + 1):
        order = args.configs if n % 2 else list(reversed(args.configs))
        for config in order:
            raw, idle, seconds = await count(config, args.prompt, args.requests, args.keep)
            net = raw - idle * seconds / args.requests
            results[config].append(net)
            print(
                f"  round {n}: {config:8s} {net / 1000:8,.1f} K net ({raw / 1000:,.1f} K in the window, "
                f"less {idle / 1e6:,.2f} M/s idle over {seconds:.0f} s under callgrind)",
                flush=True,
            )
    first = args.configs[0]
    for config in args.configs[1:]:
        ratios = [b / a for a, b in zip(results[first], results[config], strict=True)]
        print(f"{config} / {first}, per round: " + ", ".join(f"{r:.3f}" for r in ratios))
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000, help="requests in each counted window")
    parser.add_argument("--rounds", type=int, default=2, help="rounds, each counting every configuration")
    parser.add_argument(
        "--configs",
        nargs="+",
        choices=("default", "quiet", "precise", "bare", "raw"),
        default=["default", "precise"],
    )
    parser.add_argument("--keep", type=Path, default=None, help="copy callgrind's output files here")
    parser.add_argument("--prompt", choices=("tiny", "chat"), default="tiny")
    sys.exit(asyncio.run(main(parser.parse_args())))
