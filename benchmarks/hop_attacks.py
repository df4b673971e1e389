"""Attacks on the proxied hop against ``taogate serve`` in a process of its own, beside a normal
client: each row gives what the attack got, the normal client's slowest request while it ran, the
gateway process's RSS growth (after each round), and its file descriptors and instance slots back
to where they were. One instant emulator serves the normal client; a scripted instance (the
hostile tests' own) serves the attacked model. Table-driven: ``ATTACKS`` lists them.

Run through ``benchmarks/hostile.py --hop`` (or this file alone).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import re
import socket
import sys
import tempfile
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from fleetprocs import ROOT, emulators, gateway

# The hostile tests' scripted peers, reused as they are (imported by name: the tests are outside
# what mypy checks, so they come in untyped).
sys.path.insert(0, str(ROOT))
_helpers: Any = importlib.import_module("tests.hostile.helpers")
KEY: str = importlib.import_module("tests.conftest").KEY
HOSTILE: str = _helpers.HOSTILE
Neighbour, ScriptedInstance, answer_json = _helpers.Neighbour, _helpers.ScriptedInstance, _helpers.answer_json
big_then_silent = importlib.import_module("tests.hostile.test_transport").big_then_silent

AUTH = {"authorization": f"Bearer {KEY}"}


@dataclass
class Seen:
    """What one attack measured."""

    result: str = ""
    rss_mib: list[float] = field(default_factory=list)  # growth over the start, after each round


@dataclass(frozen=True)
class Attack:
    name: str
    answer: Callable[[socket.socket, bytes, bytes], None]  # the scripted instance's
    run: Callable[[str, Any, int, Seen], Awaitable[None]]  # (gateway url, it, pid, out)


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) << 10
    return 0


def _fds(pid: int) -> int:
    return len(list(Path(f"/proc/{pid}/fd").iterdir()))


def _slots(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(float(m) for m in re.findall(r"^taogate_instance_inflight\{[^}]*\} (\S+)$", text, re.M))


# -- percent-encoded CR LF, NUL and space in a stored response's path -----------------------------
INJECTED = [
    "/v1/responses/x%0d%0aX-Injected:%20yes%0d%0aX-P:%20/cancel",
    "/v1/responses/x%00y",
    "/v1/responses/x%20HTTP%2F1.1%0d%0aX-Injected:%20yes",
]


def _ok(sock: socket.socket, head: bytes, body: bytes) -> None:
    sock.sendall(answer_json())


async def _inject(url: str, scripted: Any, pid: int, out: Seen) -> None:
    async with httpx.AsyncClient(headers=AUTH, timeout=30) as http:
        statuses = [(await http.post(url + path)).status_code for path in INJECTED * 10]
    lines = [h.split(b"\r\n", 1)[0] for h in scripted.heads]
    smuggled = sum(b"x-injected" in h.lower().split(b"\r\n", 1)[1] or b"\x00" in h for h in scripted.heads)
    counts = ", ".join(f"{statuses.count(s)}× {s}" for s in sorted(set(statuses)))
    out.result = (
        f"{len(statuses)} sent ({counts}: the emulator's for ids it does not hold); {len(lines)} "
        f"reached the scripted instance, {smuggled} with an injected header or a NUL"
    )


# -- answers that fail after 60 MiB ----------------------------------------------------------------
ROUNDS, CONCURRENT, BODY_MIB = 3, 8, 60


async def _failed_answers(url: str, scripted: Any, pid: int, out: Seen) -> None:
    start = _rss(pid)
    body = {"model": HOSTILE, "prompt": "hello", "max_tokens": 2}
    statuses: list[int] = []
    async with httpx.AsyncClient(headers=AUTH, timeout=60) as http:
        for _ in range(ROUNDS):
            round_ = await asyncio.gather(
                *(http.post(url + "/v1/completions", json=body) for _ in range(CONCURRENT))
            )
            statuses += [r.status_code for r in round_]
            out.rss_mib.append((_rss(pid) - start) / 2**20)
    out.result = f"{len(statuses)} requests: " + ", ".join(
        f"{statuses.count(s)}× {s}" for s in sorted(set(statuses))
    )


ATTACKS: list[Attack] = [
    Attack("percent-encoded CR LF / NUL / space in a path", _ok, _inject),
    Attack(
        f"{CONCURRENT} answers of {BODY_MIB} MiB that then fail, {ROUNDS} rounds",
        # 2 s of silence, then the connection closes: ``taogate serve``'s request_timeout here is
        # 120 s, and a closed connection fails the same read sooner.
        big_then_silent(BODY_MIB, silence=2.0),
        _failed_answers,
    ),
]


@contextlib.contextmanager
def _beside(url: str) -> Iterator[Any]:
    neighbour = Neighbour(url)
    neighbour.start()
    try:
        yield neighbour
    finally:
        neighbour.stop()
        neighbour.join(15)


async def run(attack: Attack) -> dict[str, object]:
    with (
        tempfile.TemporaryDirectory(prefix="taogate-hop-") as tmp,
        ScriptedInstance(attack.answer) as scripted,
    ):
        work = Path(tmp)
        async with emulators(1, work / "emulators.log") as emu:
            urls = [*emu.urls, scripted.url]
            async with gateway(work, urls, "warning", KEY, "[dispatch]\nscrape_interval = 600\n") as gw:
                await asyncio.sleep(0.5)
                fds = _fds(gw.pid)
                seen = Seen()
                with _beside(gw.url) as neighbour:
                    await asyncio.sleep(0.5)
                    await attack.run(gw.url, scripted, gw.pid, seen)
                    await asyncio.sleep(1.0)
                await asyncio.sleep(3.0)  # idle pooled connections are let go after 2.5 s
                return {
                    "attack": attack.name,
                    "result": seen.result,
                    "neighbour worst ms": max(neighbour.latencies, default=0.0) * 1000,
                    "neighbour errors": len(neighbour.errors),
                    "RSS MiB": seen.rss_mib,
                    "fds": (fds, _fds(gw.pid)),
                    "slots after": _slots(gw.url),
                }


def table(rows: list[dict[str, object]]) -> str:
    out = ["| attack | result | neighbour worst | RSS growth per round | fds before → after | slots after |"]
    out.append("|---|---|---|---|---|---|")
    for r in rows:
        rss = r["RSS MiB"]
        growth = " → ".join(f"{g:.0f}" for g in rss) + " MiB" if isinstance(rss, list) and rss else "—"
        fds = r["fds"]
        assert isinstance(fds, tuple)
        out.append(
            f"| {r['attack']} | {r['result']} | {r['neighbour worst ms']:.0f} ms"
            f"{' (errors: ' + str(r['neighbour errors']) + ')' if r['neighbour errors'] else ''} | "
            f"{growth} | {fds[0]} → {fds[1]} | {r['slots after']:.0f} |"
        )
    return "\n".join(out)


async def main() -> None:
    print(table([await run(a) for a in ATTACKS]))


if __name__ == "__main__":
    asyncio.run(main())
