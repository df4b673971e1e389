"""Warm-up: small and medium prefills on an instance as it comes up, before it has served anything,
so dispatch knows its speed from the first real request.

Without it, a fleet's first burst is dispatched knowing nothing, and a slow card takes its share of
that burst before its first answer comes back. It costs each instance four prompts behind a unique
salt (nothing is cached), each with a one-token answer: a tiny one and one of ``warmup_tokens``
words (fewer if the model's context is short), twice. The quicker of each pair teaches, as a busy
host only ever adds to a prompt's time: a tiny answer held up as long as the large one would make
the card look up to four times faster than it is, a large one held up a fast card look slow.
``[dispatch] warmup_tokens = 0`` turns it off. An instance that refuses it (vLLM wants
``Content-Type: application/json``; a chat-only model has no completions) is said so in the log:
dispatch then learns its speed from traffic alone. It waits for ``ready`` first (the instance's KV
events subscribed, in precise mode), so its blocks are indexed too. ``measure`` is also how a slow
card left idle is measured again (``remeasure``).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Awaitable, Callable

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
#: Words of the tiny prompts: their time is mostly the instance's fixed latency.
_SMALL_WORDS = 8
_JSON = {"content-type": "application/json"}


def warmup_prompt(words: int) -> str:
    """``words`` plain words behind a unique salt (never a prefix-cache hit)."""
    salt = os.urandom(6).hex()
    return f"warm-up {salt} " + " ".join(_WORDS[i % len(_WORDS)] for i in range(words))


class Warmup:
    def __init__(
        self,
        client: httpx.AsyncClient,
        speeds: SpeedEstimator,
        settings: Callable[[], Settings],
        *,
        ready: Callable[[Instance], Awaitable[None]] | None = None,
    ) -> None:
        self._client = client
        self._speeds = speeds
        self._settings = settings
        self._ready = ready

    async def __call__(self, inst: Instance) -> None:
        """Teach the speed estimator the instance's base latency and prefill speed as it comes up."""
        if self._settings().dispatch.warmup_tokens <= 0 or not inst.models:
            return
        if self._ready is not None:
            await self._ready(inst)
        if await self.measure(inst):
            speed = self._speeds.speed(inst.name)
            log.info("instance %s warmed up: prefill ~%.0f tokens/s", inst.name, speed)

    async def measure(self, inst: Instance, *, afresh: bool = False) -> bool:
        """The four prompts, and what they teach; False when none was taught from (warm-up off, a
        prompt failed or refused).
        ``afresh``: what the instance's speed rests on is stale, and their answers replace it."""
        settings = self._settings()
        tokens = settings.dispatch.warmup_tokens
        if tokens <= 0 or not inst.models:
            return False
        model = min(inst.models)
        context = inst.model_cards.get(model, {}).get("max_model_len")
        if isinstance(context, int) and context > 0:
            tokens = max(8, min(tokens, context // _TOKENS_PER_WORD))
        answers: list[tuple[float, int]] = []
        for words in (_SMALL_WORDS, tokens, _SMALL_WORDS, tokens):
            got = await self._one(inst, model, words, settings.gateway.request_timeout)
            if got is None:
                return False
            answers.append(got)
        if inst.retired:  # removed from the fleet meanwhile: its speed is forgotten, not relearned
            return False
        small, large, small_again, large_again = answers
        fixed, prefill = min(small, small_again), min(large, large_again)
        if afresh:  # only now: meanwhile dispatch priced the card as it was
            self._speeds.restart(inst.name, prefill[1])
        # The fixed latency first, then the prefill after it.
        for elapsed, prompt in (fixed, prefill):
            self._speeds.observe_first_token(
                inst.name,
                ttft=elapsed,
                ahead_tokens=0,
                uncached_tokens=prompt,
                prompt_tokens=prompt,
                exact=True,
            )
        return True

    async def _one(self, inst: Instance, model: str, words: int, limit: float) -> tuple[float, int] | None:
        body = {"model": model, "prompt": warmup_prompt(words), "max_tokens": 1, "temperature": 0}
        headers = {**inst.auth_headers, **_JSON, "x-request-tag": "taogate-warmup"}  # grep-able upstream
        started = time.monotonic()
        try:
            r = await self._client.post(
                inst.spec.url + "/v1/completions", content=orjson.dumps(body), headers=headers, timeout=limit
            )
        except (httpx.HTTPError, OSError) as exc:
            log.warning("instance %s: warm-up failed (%s); its speed is learned from traffic", inst.name, exc)
            return None
        elapsed = time.monotonic() - started
        if r.status_code != 200:
            log.warning(
                "instance %s refused the warm-up (HTTP %d: %s); its speed is learned from traffic",
                inst.name,
                r.status_code,
                _reason(r.content),
            )
            return None
        try:
            prompt = orjson.loads(r.content)["usage"]["prompt_tokens"]
        except (orjson.JSONDecodeError, KeyError, TypeError):
            prompt = None
        if not isinstance(prompt, int) or prompt <= 0:
            log.warning(
                "instance %s answered the warm-up without usage.prompt_tokens; its speed is learned "
                "from traffic",
                inst.name,
            )
            return None
        return elapsed, prompt


def _reason(body: bytes, limit: int = 200) -> str:
    """The error message of an OpenAI-shaped error body, or the body's start."""
    try:
        message = orjson.loads(body)["error"]["message"]
    except (orjson.JSONDecodeError, KeyError, TypeError):
        message = body.decode("utf-8", "replace")
    return " ".join(str(message).split())[:limit]
