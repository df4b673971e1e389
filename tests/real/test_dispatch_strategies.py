"""Dispatch on a real fast + slow vLLM pair with prefix caching: on the long-prompt load (prompts
sharing a long prefix, a few at a time) the default beats round robin and least-requests."""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
import uuid

import httpx
import pytest

from taogate.app import RunningGateway, serve_gateway
from taogate.bench.scenarios import loopback_settings
from tests.real.conftest import Pair, Say

KEY = "real-tier-key"
WORDS = (
    "the",
    "gateway",
    "sends",
    "each",
    "request",
    "to",
    "the",
    "card",
    "with",
    "the",
    "least",
    "prefill",
    "work",
    "queued",
    "and",
    "learns",
)
REQUESTS = 12
CONCURRENCY = 4
RUNS = 6
ROWS: tuple[tuple[str, dict[str, object]], ...] = (
    ("round_robin", {"strategy": "round_robin", "prefix_affinity": False}),
    ("least_requests", {"strategy": "least_requests", "prefix_affinity": False}),
    ("default", {}),
)


def _prefix(words: int) -> str:
    """A long shared prefix no earlier request has (each row starts with cold caches)."""
    rng = random.Random()
    return uuid.uuid4().hex + " " + " ".join(rng.choices(WORDS, k=words))


async def _load(
    http: httpx.AsyncClient, api: str, model: str, prefix: str, *, requests: int, concurrency: int
) -> tuple[float, dict[str, int]]:
    """``requests`` prompts sharing ``prefix``, ``concurrency`` at a time: makespan and who served them."""
    served: dict[str, int] = {}
    slots = asyncio.Semaphore(concurrency)

    async def one(i: int) -> None:
        body = {
            "model": model,
            "prompt": f"{prefix} request number {i}",
            "max_tokens": 4,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        headers = {"authorization": f"Bearer {KEY}"}
        async with slots, http.stream("POST", api + "/completions", json=body, headers=headers) as r:
            await r.aread()
            assert r.status_code == 200, r.text
            name = r.headers["x-taogate-instance"]
            served[name] = served.get(name, 0) + 1

    started = time.monotonic()
    await asyncio.gather(*(one(i) for i in range(requests)))
    return time.monotonic() - started, served


async def _rows(pair: Pair, report: Say) -> dict[str, tuple[float, dict[str, int]]]:
    """Each row's best makespan of the load over ``RUNS`` rounds (each load with a fresh prefix:
    cold caches), through a gateway of its own with its [dispatch] settings (its warm-up included,
    as a user's), after a few prompts it learns from. The rows take turns round by round, so a
    slow spell of this shared machine falls on all of them alike rather than on one row's runs."""
    async with contextlib.AsyncExitStack() as stack:
        http = await stack.enter_async_context(httpx.AsyncClient(timeout=120, trust_env=False))
        gates: dict[str, RunningGateway] = {}
        for label, dispatch in ROWS:
            settings = loopback_settings(
                [s.url for s in pair.servers],
                names=[s.spec.label for s in pair.servers],
                gateway={"request_timeout": 120},
                dispatch=dispatch,
            )
            gates[label] = await stack.enter_async_context(serve_gateway(settings, key=KEY))
        for gate in gates.values():
            for _ in range(3):  # a gateway in service has seen traffic: unique prompts, not timed
                await _load(http, gate.api_base, pair.model, _prefix(300), requests=2, concurrency=2)
        runs: dict[str, list[tuple[float, dict[str, int]]]] = {label: [] for label in gates}
        for _ in range(RUNS):
            for label, gate in gates.items():
                runs[label].append(
                    await _load(
                        http,
                        gate.api_base,
                        pair.model,
                        _prefix(1200),
                        requests=REQUESTS,
                        concurrency=CONCURRENCY,
                    )
                )
        for label, gate in gates.items():
            rows = (
                await http.get(gate.url + "/admin/instances", headers={"authorization": f"Bearer {KEY}"})
            ).json()
            learned = {r["name"]: (round(r["speed"]), r["speed_samples"]) for r in rows["instances"]}
            spans = [round(r[0], 2) for r in runs[label]]
            slow = [r[1].get("slow", 0) for r in runs[label]]
            report(f"  {label}: learned (speed, samples) {learned}; makespans {spans}, slow card {slow}")
        return {label: min(r, key=lambda run: run[0]) for label, r in runs.items()}


# Three gateways, each warmed up and then timed six times: some 250 prompts, most of 1,200 words, the
# slow card's share of them prefilled at its pace, which on two shared cores has been seen 15x the
# fast card's. That takes minutes on a slow machine (benchmarks/README.md, 2026-12-06).
@pytest.mark.timeout(600, func_only=True)
async def test_the_default_beats_round_robin_and_least_requests(vllm_pair: Pair, report: Say) -> None:
    for server in vllm_pair.servers:
        server.check_alive()
    best = await _rows(vllm_pair, report)
    spans = {label: span for label, (span, _) in best.items()}
    for label, (span, served) in best.items():
        report(f"long-prompt load, {label}: {span:.2f} s, served {served}")
    default = spans["default"]
    report(
        f"long-prompt load: default throughput {spans['round_robin'] / default:.2f}x round robin's, "
        f"{spans['least_requests'] / default:.2f}x least-requests'"
    )
    assert default < spans["round_robin"], spans
    assert default < spans["least_requests"], spans
