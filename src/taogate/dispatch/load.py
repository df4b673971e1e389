"""The load estimate: expected seconds until a request's first token on one instance (and its end).

Least busy means least *work*: a 4,096-token prefill is not a 50-token one, and a slow instance drains
the same work more slowly. For a request costing ``P`` prefill tokens on instance ``i``::

    ttft_i = base_i + (queued_i + P) * slow_i / speed_i + kv_i
    end_i  = ttft_i + min(max_tokens, decode_horizon) * tpot_i * batch_i

``queued_i`` is our own booked prefill there plus what the engine reports queued by others;
``slow_i`` grows with the decodes sharing each step; ``kv_i`` is the wait a nearly full KV cache
adds (a running request must free blocks, or one is preempted and prefilled again: a wait of about
one request, not a slower prefill of the whole queue); ``batch_i`` spreads a burst of cache hits or
tiny prompts evenly. ``estimate`` computes it all in one flat pass; the small functions below spell
the formula out term by term, and a property test holds the two equal. Most of it depends on the
view alone: ``view_terms`` computes that part once per view (a kept view is priced by many dispatches),
and the policy adds the request's own part (a property test holds it equal to ``estimate``).
Each term's reasons and measurements: benchmarks/README.md, "Design notes moved from the code".
"""

from __future__ import annotations

from dataclasses import dataclass

from .types import InstanceView, ViewTerms

__all__ = [
    "DEFAULT_LOAD",
    "LoadModel",
    "batch_factor",
    "decode_seconds",
    "estimate",
    "expected_latency",
    "expected_prefill",
    "expected_ttft",
    "horizon",
    "kv_wait",
    "queued_tokens",
    "slowdown",
    "view_terms",
]


@dataclass(frozen=True, slots=True)
class LoadModel:
    """The constants of the formula; the gateway may update ``typical_prompt_tokens`` from traffic."""

    typical_prompt_tokens: float = 1024.0  # assumed size of each foreign waiting request
    step_tokens: float = 2048.0  # engine tokens per step (vLLM max_num_batched_tokens)
    decode_weight: float = 1.0  # prefill tokens displaced per running sequence per step
    kv_threshold: float = 0.9  # KV-cache usage above which a new request waits for blocks
    kv_penalty: float = 1.0  # waits at 100 % KV usage, each a decode and a re-prefill
    decode_horizon: int = 16  # output tokens counted in expected_latency (0: TTFT only)
    decode_batch_ref: float = 32.0  # sequences sharing the steps that double a step's time (0: off)


DEFAULT_LOAD = LoadModel()


def estimate(
    view: InstanceView, prompt_tokens: float, max_tokens: int | None = None, model: LoadModel = DEFAULT_LOAD
) -> tuple[float, float]:
    """(``expected_ttft``, ``expected_latency``) of a request costing ``prompt_tokens`` of prefill on
    ``view``: the formula of the module docstring in one pass (the functions below, term by term)."""
    _, queued, per_token, base, kv, tpot, batch = view_terms(view, model)
    ttft = base + (queued + (prompt_tokens if prompt_tokens > 0 else 0.0)) * per_token + kv
    if not tpot > 0.0:
        return ttft, ttft
    return ttft, ttft + horizon(max_tokens, model) * tpot * batch


def view_terms(view: InstanceView, model: LoadModel = DEFAULT_LOAD) -> ViewTerms:
    """The part of ``estimate`` that depends on ``view`` and ``model`` alone: ``(model, queued,
    per_token, base, kv, tpot, batch)``. A request costing ``P`` prefill tokens there is expected
    to take ``base + (queued + P) * per_token + kv`` seconds to its first token (``kv``: the KV
    wait, 0.0 below the threshold), and ``horizon(max_tokens) * tpot * batch`` more to its end
    unless ``tpot`` (the decode pace) is 0.0, unknown. A plain tuple: it is built for each view
    priced afresh."""
    booked_work = view.prefill_work
    if booked_work is not None:
        queued = float(booked_work) if booked_work > 0 else 0.0
    else:
        ratio = view.uncached_ratio
        ratio = 0.0 if not ratio > 0.0 else 1.0 if ratio > 1.0 else ratio
        booked = view.prefill_tokens
        queued = booked * ratio if booked > 0 else 0.0
    decoding = view.decoding
    running = float(decoding) if decoding > 0 else 0.0
    inflight = view.inflight
    n = float(inflight) if inflight > 0 else 0.0
    kv = None
    engine = view.engine
    if engine is not None:
        prefilling = view.prefilling
        own = (inflight - decoding) if prefilling is None else prefilling
        foreign = engine.waiting - (own if own > 0 else 0)
        if foreign > 0:
            queued += foreign * model.typical_prompt_tokens
        if engine.running > running:  # noqa: PLR1730 (flat on purpose: see the module docstring)
            running = engine.running
        kv = engine.kv_usage
        if engine.running + engine.waiting > n:  # noqa: PLR1730
            n = engine.running + engine.waiting
    factor = 1.0 + model.decode_weight * running / model.step_tokens
    base = view.base_latency
    speed = view.speed
    per_token = factor / (speed if speed > 1e-9 else 1e-9)
    tpot = view.decode_seconds_per_token
    if not tpot > 0.0:
        tpot = 0.0
    wait = 0.0
    if kv is not None and kv > model.kv_threshold:
        over = (kv - model.kv_threshold) / max(1e-9, 1.0 - model.kv_threshold)
        over = 1.0 if over > 1.0 else over
        one = model.typical_prompt_tokens * per_token
        if tpot > 0.0:
            one += model.decode_horizon * tpot
        wait = model.kv_penalty * over * over * one
    ref = model.decode_batch_ref
    batch = 1.0 + n / ref if ref > 0 else 1.0
    return (model, queued, per_token, base if base > 0.0 else 0.0, wait, tpot, batch)


def horizon(max_tokens: int | None, model: LoadModel = DEFAULT_LOAD) -> int:
    """Output tokens ``estimate`` counts for a request with this ``max_tokens``."""
    horizon = model.decode_horizon
    if max_tokens is not None and max_tokens < horizon:
        horizon = max_tokens if max_tokens > 0 else 0
    return horizon


def queued_tokens(view: InstanceView, model: LoadModel = DEFAULT_LOAD) -> float:
    """Prefill tokens ahead of a new request on this instance (ours exactly, others' estimated)."""
    if view.prefill_work is not None:
        queued = float(max(0, view.prefill_work))
    else:
        queued = float(max(0, view.prefill_tokens)) * min(1.0, max(0.0, view.uncached_ratio))
    if view.engine is not None:
        foreign = max(0.0, view.engine.waiting - view.own_prefilling)
        queued += foreign * model.typical_prompt_tokens
    return queued


def slowdown(view: InstanceView, model: LoadModel = DEFAULT_LOAD) -> float:
    """Factor (≥ 1) by which the decoding sequences sharing each step slow this instance's prefill."""
    running = float(max(0, view.decoding))
    if view.engine is not None:
        running = max(running, view.engine.running)
    return 1.0 + model.decode_weight * running / model.step_tokens


def kv_wait(view: InstanceView, model: LoadModel = DEFAULT_LOAD) -> float:
    """Seconds a nearly full KV cache adds before a new request's first token there.

    Above ``kv_threshold`` a new request waits for a running one to free its blocks, and vLLM may
    preempt one and prefill it again: each wait is priced as one decode of ``decode_horizon`` tokens
    plus one typical prompt's prefill, ``kv_penalty`` of them at 100 %, growing quadratically from
    the threshold.
    A wait, not a slower prefill: on a small cache two requests fill it, and a multiplier on the
    whole queue made a card that was about to drain look many times slower than it is.
    """
    kv = view.engine.kv_usage if view.engine is not None else None
    if kv is None or kv <= model.kv_threshold:
        return 0.0
    over = min(1.0, (kv - model.kv_threshold) / max(1e-9, 1.0 - model.kv_threshold))
    one = model.typical_prompt_tokens * slowdown(view, model) / max(view.speed, 1e-9)
    one += model.decode_horizon * max(0.0, view.decode_seconds_per_token)
    return model.kv_penalty * over * over * one


def expected_prefill(prompt_tokens: float, warm_prefix: float = 0.0) -> float:
    """Prefill tokens a ``prompt_tokens`` request is expected to cost on an instance (at least 1).

    ``warm_prefix`` > 0: the instance is known to hold that many tokens of this prompt's prefix (the
    affinity policy remembers where it sent each prefix key), so only the rest is prefilled: vLLM's
    prefix cache (like the emulator's) recomputes only the blocks it does not hold.
    """
    prompt = max(0.0, prompt_tokens)
    return max(1.0, prompt - max(0.0, warm_prefix))


def expected_ttft(view: InstanceView, prompt_tokens: float, model: LoadModel = DEFAULT_LOAD) -> float:
    """Expected seconds until the first token of a request costing ``prompt_tokens`` of prefill on
    ``view``, sent now."""
    work = queued_tokens(view, model) + max(0.0, prompt_tokens)
    per_token = slowdown(view, model) / max(view.speed, 1e-9)
    return max(0.0, view.base_latency) + work * per_token + kv_wait(view, model)


def decode_seconds(
    view: InstanceView, max_tokens: int | None = None, model: LoadModel = DEFAULT_LOAD
) -> float:
    """Expected seconds to decode the first ``min(max_tokens, decode_horizon)`` tokens on ``view``."""
    horizon = model.decode_horizon if max_tokens is None else min(max(0, max_tokens), model.decode_horizon)
    return horizon * max(0.0, view.decode_seconds_per_token) * batch_factor(view, model)


def batch_factor(view: InstanceView, model: LoadModel = DEFAULT_LOAD) -> float:
    """Factor (≥ 1) by which the sequences already sharing this instance's steps slow one more.

    Every engine step carries one token of each running sequence, so a step takes longer the more
    sequences share it (memory traffic for their KV, the sampler): ``1 + n / decode_batch_ref``, with
    ``n`` our requests there, or what its engine reports running and waiting if that is more.
    """
    if model.decode_batch_ref <= 0:
        return 1.0
    n = float(max(0, view.inflight))
    if view.engine is not None:
        n = max(n, view.engine.running + view.engine.waiting)
    return 1.0 + n / model.decode_batch_ref


def expected_latency(
    view: InstanceView,
    prompt_tokens: float,
    max_tokens: int | None = None,
    model: LoadModel = DEFAULT_LOAD,
) -> float:
    """``expected_ttft`` plus ``decode_seconds``."""
    return expected_ttft(view, prompt_tokens, model) + decode_seconds(view, max_tokens, model)
