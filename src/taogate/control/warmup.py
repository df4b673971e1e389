"""Warm-up: one small and one medium prefill on an instance as it comes up, before it has served
anything, so dispatch knows its speed and decode pace from the first real request.

Without it, a fleet's first burst is dispatched knowing nothing, and a slow card takes its share of
that burst before its first answer comes back. It costs each instance two prompts behind a unique
salt (nothing is cached): a tiny one, streamed with a ``DECODE_TOKENS`` answer (its first token is
the fixed latency, the rest the decode pace), and one of ``warmup_tokens`` words (fewer if the
model's context is short) with a one-token answer; ``[dispatch] warmup_tokens = 0`` turns it off.
Without its own decode pace an instance's would be extrapolated from one prefill sample, which on
equal cards differs by several times from one to the next and would send a whole burst to one of
them. An instance
that refuses it (vLLM wants ``Content-Type: application/json``; a chat-only model has no completions)
is said so in the log: dispatch then learns its speed from traffic alone.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx
import orjson

from taogate.dispatch.speed import SpeedEstimator
from taogate.fleet.instance import Instance
from taogate.settings import Settings

__all__ = ["Warmup", "warmup_prompt"]

log = logging.getLogger("taogate.health")

_WORDS = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet")
#: Tokens a warm-up word may cost on an unknown tokenizer: the prompt must fit the model's context.
_TOKENS_PER_WORD = 4
_JSON = {"content-type": "application/json"}
#: Output tokens of the small warm-up prompt: enough decode steps that their pace is not one step's.
DECODE_TOKENS = 16


def warmup_prompt(words: int) -> str:
    """``words`` plain words behind a unique salt (never a prefix-cache hit)."""
    salt = os.urandom(6).hex()
    return f"warm-up {salt} " + " ".join(_WORDS[i % len(_WORDS)] for i in range(words))


class Warmup:
    def __init__(
        self, client: httpx.AsyncClient, speeds: SpeedEstimator, settings: Callable[[], Settings]
    ) -> None:
        self._client = client
        self._speeds = speeds
        self._settings = settings

    async def __call__(self, inst: Instance) -> None:
        """Teach the speed estimator the instance's base latency and prefill speed."""
        settings = self._settings()
        tokens = settings.dispatch.warmup_tokens
        if tokens <= 0 or not inst.models:
            return
        model = min(inst.models)
        context = inst.model_cards.get(model, {}).get("max_model_len")
        if isinstance(context, int) and context > 0:
            tokens = max(8, min(tokens, context // _TOKENS_PER_WORD))
        # The small one is mostly fixed latency, then decode; the large one mostly prefill.
        for words, answer in ((8, DECODE_TOKENS), (tokens, 1)):
            got = await self._one(inst, model, words, answer, settings.gateway.request_timeout)
            if got is None:
                return
            speeds = self._speeds
            speeds.observe_first_token(
                inst.name,
                ttft=got.ttft,
                ahead_tokens=0,
                uncached_tokens=got.prompt,
                prompt_tokens=got.prompt,
                exact=True,
            )
            if got.completion > 1:
                speeds.observe_completion(
                    inst.name,
                    duration=got.seconds,
                    completion_tokens=got.completion,
                    ahead_tokens=0,
                    uncached_tokens=got.prompt,
                    prompt_tokens=got.prompt,
                    ttft=got.ttft,
                )
        log.info(
            "instance %s warmed up: prefill ~%.0f tokens/s, decode %.1f ms a token",
            inst.name,
            self._speeds.speed(inst.name),
            1000 * self._speeds.decode_seconds_per_token(inst.name),
        )

    async def _one(self, inst: Instance, model: str, words: int, answer: int, limit: float) -> _Answer | None:
        """One streamed warm-up completion: when its first token came, when it ended, its usage."""
        body = {
            "model": model,
            "prompt": warmup_prompt(words),
            "max_tokens": answer,
            "temperature": 0,
            "ignore_eos": True,  # vLLM's: the whole answer is decoded, so its pace is measured
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        headers = {**inst.auth_headers, **_JSON, "x-request-tag": "taogate-warmup"}  # grep-able upstream
        started = time.monotonic()
        ttft: float | None = None
        usage: dict[str, object] = {}
        try:
            async with self._client.stream(
                "POST",
                inst.spec.url + "/v1/completions",
                content=orjson.dumps(body),
                headers=headers,
                timeout=limit,
            ) as r:
                if r.status_code != 200:
                    log.warning(
                        "instance %s refused the warm-up (HTTP %d: %s); its speed is learned from traffic",
                        inst.name,
                        r.status_code,
                        _reason(await r.aread()),
                    )
                    return None
                async for line in r.aiter_lines():
                    event = _event(line)
                    if event is None:
                        continue
                    if ttft is None and any(
                        c.get("text") for c in event.get("choices") or () if isinstance(c, dict)
                    ):
                        ttft = time.monotonic() - started
                    if isinstance(event.get("usage"), dict):
                        usage = event["usage"]
        except (httpx.HTTPError, OSError) as exc:
            log.warning("instance %s: warm-up failed (%s); its speed is learned from traffic", inst.name, exc)
            return None
        seconds = time.monotonic() - started
        prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
        if not isinstance(prompt, int) or prompt <= 0 or not isinstance(completion, int):
            return None
        return _Answer(ttft if ttft is not None else seconds, seconds, prompt, completion)


@dataclass(frozen=True, slots=True)
class _Answer:
    ttft: float  # seconds to the first token (the whole answer's, if no token had text)
    seconds: float  # to the end of the stream
    prompt: int  # usage.prompt_tokens
    completion: int  # usage.completion_tokens


def _event(line: str) -> dict[str, Any] | None:
    """One server-sent event's JSON object (None: not a data line, [DONE], or not an object)."""
    if not line.startswith("data:"):
        return None
    data = line[5:].strip()
    if data == "[DONE]":
        return None
    try:
        event = orjson.loads(data)
    except orjson.JSONDecodeError:
        return None
    return event if isinstance(event, dict) else None


def _reason(body: bytes, limit: int = 200) -> str:
    """The error message of an OpenAI-shaped error body, or the body's start."""
    try:
        message = orjson.loads(body)["error"]["message"]
    except (orjson.JSONDecodeError, KeyError, TypeError):
        message = body.decode("utf-8", "replace")
    return " ".join(str(message).split())[:limit]
