"""Shared helpers for the dispatch integration tests (not a test module).

Everything runs on 127.0.0.1 on the test's event loop: emulated vLLM instances (``run_fleet``), one or
more real gateways served by uvicorn (``serve_gateway``), and real HTTP clients.
"""

from __future__ import annotations

import asyncio
import functools
import random
from collections import Counter
from collections.abc import Callable, Sequence
from contextlib import suppress
from dataclasses import dataclass, field
from typing import Any

import httpx

from taogate.app import RunningGateway
from taogate.emulator.fleet import Fleet
from tests.conftest import KEY, gateway_settings, serve, wait_until

MODEL = "emulated-model"
AUTH = {"authorization": f"Bearer {KEY}"}

_LETTERS = "bcdfghjklmnpqrstvwxz"


def words(n_tokens: int, seed: int) -> str:
    """``n_tokens`` distinct-ish three-letter words: one emulator token each, and 4 characters per token,
    so the gateway's uncalibrated estimate (4 chars/token) is already right."""
    rng = random.Random(seed)
    return " ".join("".join(rng.choice(_LETTERS) for _ in range(3)) for _ in range(n_tokens))


settings_for = gateway_settings  # instance roles and names can be given


serve_gateway = serve


def client(timeout: float = 30.0) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=200, max_keepalive_connections=200)
    return httpx.AsyncClient(headers=AUTH, timeout=timeout, limits=limits)


async def complete(
    http: httpx.AsyncClient,
    gate: RunningGateway | str,
    prompt: str,
    *,
    max_tokens: int = 2,
    stream: bool = False,
    headers: dict[str, str] | None = None,
) -> httpx.Response:
    """POST /v1/completions through the gateway; a stream is read to its end (the body stays readable)."""
    api = gate if isinstance(gate, str) else gate.api_base
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "stream": stream}
    if not stream:
        return await http.post(api + "/completions", json=body, headers=headers)
    async with http.stream("POST", api + "/completions", json=body, headers=headers) as response:
        await response.aread()
    return response


def records(fleet: Fleet) -> list[list[dict[str, Any]]]:
    """Per emulator instance, the request records it kept (who served what, when, with which tag)."""
    return [inst.stats()["records"] for inst in fleet.instances]


def served_counts(fleet: Fleet, min_prompt: int = 0) -> list[int]:
    """Completed generation requests per instance whose prompt had at least ``min_prompt`` tokens."""
    return [
        sum(1 for r in recs if r["status"] == 200 and r["prompt_tokens"] >= min_prompt)
        for recs in records(fleet)
    ]


def max_overlap(recs: Sequence[dict[str, Any]], min_prompt: int) -> int:
    """Most requests of at least ``min_prompt`` tokens that were waiting for their first token on one
    instance at the same time: how deep long prompts piled up behind each other there."""
    events: list[tuple[float, int]] = []
    for r in recs:
        if r["prompt_tokens"] >= min_prompt and r["first_token"] is not None:
            events += [(r["arrival"], 1), (r["first_token"], -1)]
    depth = peak = 0
    for _, step in sorted(events):  # at equal times a departure (-1) sorts before an arrival
        depth += step
        peak = max(peak, depth)
    return peak


def hit_rate(fleet: Fleet) -> float:
    """Prefix-cache hit rate over the fleet: cached prompt tokens / prompt tokens."""
    prompt = cached = 0
    for recs in records(fleet):
        for r in recs:
            prompt += r["prompt_tokens"]
            cached += r["cached_tokens"]
    return cached / prompt if prompt else 0.0


def header_counts(responses: Sequence[httpx.Response]) -> Counter[str]:
    return Counter(r.headers.get("x-taogate-instance", "?") for r in responses)


async def admin_rows(http: httpx.AsyncClient, gate: RunningGateway) -> dict[str, dict[str, Any]]:
    r = await http.get(gate.url + "/admin/instances")
    assert r.status_code == 200, r.text
    return {row["name"]: row for row in r.json()["instances"]}


@dataclass
class PeakWatch:
    """Samples ``probe()`` (one number per instance) every ``period`` s on the loop; keeps the peaks.

    The gateway, the emulators and this watcher share one event loop, so every sample is a consistent
    snapshot between two steps of the servers: no torn reads.
    """

    probe: Callable[[], Sequence[int]]
    check: Callable[[], None] | None = None  # an invariant asserted at every sample
    period: float = 0.002
    peaks: list[int] = field(default_factory=list)
    samples: int = 0
    _task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        while True:
            values = list(self.probe())
            if not self.peaks:
                self.peaks = [0] * len(values)
            self.peaks = [max(a, b) for a, b in zip(self.peaks, values, strict=True)]
            if self.check is not None:
                self.check()
            self.samples += 1
            await asyncio.sleep(self.period)

    async def __aenter__(self) -> PeakWatch:
        self._task = asyncio.get_running_loop().create_task(self._run())
        await asyncio.sleep(0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        if self._task.done():
            self._task.result()  # re-raise a broken invariant
        self._task.cancel()
        with suppress(asyncio.CancelledError):
            await self._task


def _reached(count: Callable[[], int], target: int) -> bool:
    return count() >= target


async def send_in_order(
    http: httpx.AsyncClient,
    gate: RunningGateway,
    fleet: Fleet,
    requests: Sequence[tuple[str, int]],
) -> list[httpx.Response]:
    """Start the (prompt, max_tokens) requests one after another, each only once the previous one
    reached an instance, so the gateway decides them in exactly this order (without waiting for any
    of them to finish)."""

    def seen() -> int:
        return sum(inst.book.requests_seen for inst in fleet.instances)

    base = seen()
    tasks: list[asyncio.Task[httpx.Response]] = []
    for n, (prompt, max_tokens) in enumerate(requests):
        tasks.append(asyncio.create_task(complete(http, gate, prompt, max_tokens=max_tokens)))
        await wait_until(
            functools.partial(_reached, seen, base + n + 1), within=10.0, what=f"request {n} sent"
        )
    return list(await asyncio.gather(*tasks))
