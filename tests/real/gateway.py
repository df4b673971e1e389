"""A gateway in front of real vLLM servers, the traffic the tier sends through it, and what it reads
back (the gateway's admin rows, vLLM's own /metrics)."""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import openai

from taogate.app import RunningGateway, serve_gateway
from taogate.fleet.engine import EngineSample, parse_vllm_metrics
from taogate.settings import Settings
from tests.real.server import SERVED_MODEL, VllmServer

KEY = "real-tier-key"
WORDS: tuple[str, ...] = ("the", "gateway", "sends", "each", "request", "to", "the", "card", "with")
WORDS += ("the", "least", "prefill", "work", "queued", "and", "learns")


#: A generation that keeps a card busy for seconds (random weights rarely stop on their own).
LONG_GENERATION: dict[str, Any] = {
    "model": SERVED_MODEL,
    "prompt": "go on",
    "max_tokens": 3000,
    "temperature": 0,
    "ignore_eos": True,
}


def unique_prompt(words: int, rng: random.Random | None = None) -> str:
    """A prompt no other request shares a cache block with (~1.45 tokens per word here)."""
    rng = rng or random.Random()
    return uuid.uuid4().hex + " " + " ".join(rng.choices(WORDS, k=words))


def settings_for(
    servers: Sequence[VllmServer], *, names: Sequence[str] | None = None, **sections: dict[str, Any]
) -> Settings:
    """The gateway's defaults, as a user runs it, on a loopback port in front of ``servers``
    (named by their labels); ``sections`` override, as in config.toml."""
    labels = list(names) if names is not None else [s.spec.label for s in servers]
    data: dict[str, Any] = {
        "gateway": {"base_url": "http://127.0.0.1:8080", "host": "127.0.0.1", "shutdown_timeout": 5},
        "instances": [{"url": s.url, "name": n} for s, n in zip(servers, labels, strict=True)],
    }
    for name, values in sections.items():
        data.setdefault(name, {}).update(values)
    return Settings(**data)


@asynccontextmanager
async def real_gateway(
    servers: Sequence[VllmServer], *, names: Sequence[str] | None = None, **sections: dict[str, Any]
) -> AsyncIterator[RunningGateway]:
    async with serve_gateway(settings_for(servers, names=names, **sections), key=KEY) as gw:
        yield gw


def sdk(gw: RunningGateway) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=gw.api_base, api_key=gw.key, max_retries=0, timeout=120)


@dataclass(frozen=True)
class Reply:
    instance: str
    prompt_tokens: int


async def one_request(
    client: openai.AsyncOpenAI, prompt: str, *, stream: bool, max_tokens: int = 16
) -> Reply:
    """One completion through the gateway; who served it comes from ``x-taogate-instance``."""
    body: dict[str, Any] = {
        "model": SERVED_MODEL,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
    }
    if not stream:
        raw = await client.completions.with_raw_response.create(**body)
        return Reply(raw.headers["x-taogate-instance"], raw.parse().usage.prompt_tokens)
    raw = await client.completions.with_raw_response.create(
        **body, stream=True, stream_options={"include_usage": True}
    )
    tokens = 0
    async for chunk in raw.parse():
        if chunk.usage is not None:
            tokens = chunk.usage.prompt_tokens
    return Reply(raw.headers["x-taogate-instance"], tokens)


async def traffic(
    gw: RunningGateway,
    *,
    requests: int,
    concurrency: int,
    stream: bool,
    words: int = 700,
    max_tokens: int = 16,
) -> Counter[str]:
    """``requests`` unique prompts, ``concurrency`` at a time; how many each instance served."""
    served: Counter[str] = Counter()
    slots = asyncio.Semaphore(concurrency)
    rng = random.Random(requests * 2 + stream)

    async def one(client: openai.AsyncOpenAI) -> None:
        async with slots:
            reply = await one_request(client, unique_prompt(words, rng), stream=stream, max_tokens=max_tokens)
            served[reply.instance] += 1

    async with sdk(gw) as client:
        await asyncio.gather(*(one(client) for _ in range(requests)))
    return served


async def admin_rows(gw: RunningGateway) -> dict[str, dict[str, Any]]:
    async with httpx.AsyncClient(timeout=30, trust_env=False) as http:
        r = await http.get(gw.url + "/admin/instances", headers={"authorization": f"Bearer {gw.key}"})
    r.raise_for_status()
    return {row["name"]: row for row in r.json()["instances"]}


async def engine_metrics(http: httpx.AsyncClient, server: VllmServer) -> EngineSample:
    """vLLM's own /metrics, read the way the gateway reads it."""
    r = await http.get(server.url + "/metrics")
    r.raise_for_status()
    return parse_vllm_metrics(r.text)


async def running(http: httpx.AsyncClient, server: VllmServer) -> float:
    return (await engine_metrics(http, server)).running or 0.0


@dataclass
class Busy:
    """What ``keep_busy`` saw: how many answers it started and how the last one ended (a status
    code, or an exception's name), for a check's failure message."""

    started: int = 0
    last: str = "none yet"
    #: The longest this process's event loop was late for a 50 ms sleep while the block ran: the
    #: gateway under test shares it, so a stall here is the test's own, not vLLM's.
    loop_late: float = 0.0


@asynccontextmanager
async def keep_busy(
    http: httpx.AsyncClient, server: VllmServer, *, stream: bool = True
) -> AsyncIterator[Busy]:
    """One long answer always running on ``server``, straight to it (past any gateway): a new one
    starts whenever the last has ended, until the block exits. A check that needs the card busy at the
    moment it looks does not depend on how fast this machine decodes ``LONG_GENERATION``."""
    body = {**LONG_GENERATION, "stream": stream}
    seen = Busy()

    async def one() -> None:
        seen.started += 1
        if stream:  # read to the end: vLLM frees the slot when the answer is done, not when read
            async with http.stream("POST", server.url + "/v1/completions", json=body) as r:
                async for _ in r.aiter_raw():
                    pass
        else:
            r = await http.post(server.url + "/v1/completions", json=body)
        seen.last = f"status {r.status_code}"

    async def forever() -> None:
        while True:
            began = time.monotonic()
            try:
                await one()
            except httpx.HTTPError as exc:
                seen.last = type(exc).__name__
            if time.monotonic() - began < 1.0:  # refused or broken at once: do not hammer the card
                await asyncio.sleep(0.5)

    async def watch_loop() -> None:
        while True:
            began = time.monotonic()
            await asyncio.sleep(0.05)
            seen.loop_late = max(seen.loop_late, time.monotonic() - began - 0.05)

    tasks = [asyncio.ensure_future(forever()), asyncio.ensure_future(watch_loop())]
    try:
        yield seen
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
