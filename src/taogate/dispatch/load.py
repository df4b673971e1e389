"""The load estimate: expected seconds until a request's first token on one instance.

Least-busy means least *work*: a 4,096-token prefill is not a 50-token one, and a slow instance drains
the same work more slowly. For a request of ``P`` prompt tokens on instance ``i``::

    queued  = prefill_tokens_i                                 # our outstanding prefill, exact, instant
            + max(0, engine.waiting - prefilling_i) * typical   # queued there by others (other replicas)
    slow    = 1 + decode_weight * running_i / step_tokens      # decodes take a token of every step
            * (1 + kv_penalty * ((kv - kv_threshold) / (1 - kv_threshold))**2   if kv > kv_threshold)
    ttft_i  = (queued + P) * slow / speed_i

* ``prefill_tokens_i`` and ``prefilling_i`` are our own requests with no first token yet (tokens and
  count). They cover the gap between scrapes: a burst dispatched within one scrape interval sees
  itself at once.
* ``engine.waiting`` counts every request queued in vLLM, ours included; subtracting our not-yet-first-
  token requests leaves (at least) the foreign ones, each assumed ``typical`` tokens long. Some of ours
  are already running rather than waiting, so the subtraction undercounts foreign work: conservative,
  it never makes an instance look busier than it is because of us.
* ``running_i`` is ``max(engine.running, our decoding)``: the scrape may be a second old. Each running
  sequence takes one token of each engine step's budget (``step_tokens``, vLLM's
  ``max_num_batched_tokens``), so prefill runs a little slower; the term stays modest on purpose,
  since the learned ``speed`` already absorbs a typical decode load.
* Near-full KV cache means vLLM preempts and re-prefills sequences; above ``kv_threshold`` the penalty
  grows quadratically, to ``1 + kv_penalty`` times at 100 %.
* ``engine`` is ``None`` when never scraped or too stale (the gateway decides): then our own counts
  alone, which are exact for single-gateway deployments.

Pure arithmetic over an ``InstanceView``, microseconds per call.
"""

from __future__ import annotations

from dataclasses import dataclass

from .types import InstanceView

__all__ = ["DEFAULT_LOAD", "LoadModel", "expected_ttft", "queued_tokens", "slowdown"]


@dataclass(frozen=True, slots=True)
class LoadModel:
    """The constants of the formula; the gateway may update ``typical_prompt_tokens`` from traffic."""

    typical_prompt_tokens: float = 1024.0  # assumed size of each foreign waiting request
    step_tokens: float = 2048.0  # engine tokens per step (vLLM max_num_batched_tokens)
    decode_weight: float = 1.0  # prefill tokens displaced per running sequence per step
    kv_threshold: float = 0.9  # KV-cache usage above which preemption looms
    kv_penalty: float = 10.0  # extra slowdown factor at 100 % KV usage


DEFAULT_LOAD = LoadModel()


def queued_tokens(view: InstanceView, model: LoadModel = DEFAULT_LOAD) -> float:
    """Prefill tokens ahead of a new request on this instance (ours exactly, others' estimated)."""
    queued = float(max(0, view.prefill_tokens))
    if view.engine is not None:
        foreign = max(0.0, view.engine.waiting - view.own_prefilling)
        queued += foreign * model.typical_prompt_tokens
    return queued


def slowdown(view: InstanceView, model: LoadModel = DEFAULT_LOAD) -> float:
    """Factor (≥ 1) by which decoding sequences and KV pressure slow this instance's prefill."""
    running = float(max(0, view.decoding))
    kv = None
    if view.engine is not None:
        running = max(running, view.engine.running)
        kv = view.engine.kv_usage
    factor = 1.0 + model.decode_weight * running / model.step_tokens
    if kv is not None and kv > model.kv_threshold:
        over = min(1.0, (kv - model.kv_threshold) / max(1e-9, 1.0 - model.kv_threshold))
        factor *= 1.0 + model.kv_penalty * over * over
    return factor


def expected_ttft(view: InstanceView, prompt_tokens: float, model: LoadModel = DEFAULT_LOAD) -> float:
    """Expected seconds until the first token of a ``prompt_tokens`` request sent to ``view`` now."""
    work = queued_tokens(view, model) + max(0.0, prompt_tokens)
    return work * slowdown(view, model) / max(view.speed, 1e-9)
