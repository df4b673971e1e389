"""Warm-up: one small and one medium prefill on an instance as it comes up, before it has served
anything, so least-busy knows its speed from the first real request.

Without it, a fleet's first burst is dispatched knowing nothing: measured on the article's load, a
quarter of the first requests landed on a 2.5x slow card before its first sample came back. The
probe costs one ~2,000-token prefill per instance (unique prompt, so nothing is cached) and a
one-token answer; ``[dispatch] warmup_tokens = 0`` turns it off.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import httpx
import orjson

from taogate.dispatch.speed import SpeedEstimator

_WORDS = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet")


def warmup_prompt(words: int) -> str:
    """``words`` plain words behind a unique salt (never a prefix-cache hit)."""
    salt = os.urandom(6).hex()
    return f"warm-up {salt} " + " ".join(_WORDS[i % len(_WORDS)] for i in range(words))


@dataclass(frozen=True, slots=True)
class WarmupTarget:
    name: str
    url: str
    model: str
    headers: dict[str, str]


async def _one(
    client: httpx.AsyncClient, target: WarmupTarget, words: int, limit: float
) -> tuple[float, int] | None:
    body = {"model": target.model, "prompt": warmup_prompt(words), "max_tokens": 1, "temperature": 0}
    started = time.monotonic()
    try:
        r = await client.post(
            target.url + "/v1/completions", content=orjson.dumps(body), headers=target.headers, timeout=limit
        )
    except (httpx.HTTPError, OSError):
        return None
    elapsed = time.monotonic() - started
    if r.status_code != 200:
        return None  # e.g. a chat-only model: no warm-up, dispatch learns from traffic instead
    try:
        prompt = orjson.loads(r.content)["usage"]["prompt_tokens"]
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return None
    return (elapsed, prompt) if isinstance(prompt, int) and prompt > 0 else None


async def warm_up(
    client: httpx.AsyncClient, speeds: SpeedEstimator, target: WarmupTarget, *, tokens: int, limit: float
) -> float | None:
    """Teach ``speeds`` the instance's base latency and prefill speed; returns the learned speed."""
    for words in (8, tokens):  # the small one is mostly fixed latency, the large one mostly prefill
        got = await _one(client, target, words, limit)
        if got is None:
            return None
        elapsed, prompt = got
        speeds.observe_first_token(
            target.name, ttft=elapsed, ahead_tokens=0, uncached_tokens=prompt, prompt_tokens=prompt
        )
    return speeds.speed(target.name)
