"""A route receipt: why a request went where it went, in one bounded line.

``explain`` prices the request on every candidate the policy saw, as ``LeastBusy`` does, and splits
the chosen instance's estimate and the runner-up's (the cheapest other) into their terms:

* ``fixed``: the instance's fixed latency (an engine step, HTTP);
* ``queued``: the prefill booked ahead of it there, at that instance's speed and slowdown;
* ``own``: its own prefill after the expected hit, with the hit and its evidence (``kv_event``: the
  instance's KV events show the blocks; ``computed``: a request with this prefix had its first
  token, or an answer, there; ``in_flight``: in flight there, not computed yet, priced as a hit
  because in-flight followers hit there (assumed until an answer shows a miss); ``sent``: only
  sent there, not computed yet, where followers were seen to miss, so no hit is priced; ``none``);
* ``kv`` (only when not zero): the wait a nearly full KV cache adds (``load.kv_wait``);
* ``decode``: the first output tokens at its learned pace;
* ``adjust`` (only when not zero): what a miss would evict, less its share of a hot prefix's copy.

The line is what ``X-Taogate-Route: 1`` (or ``[dispatch] route_receipt``) puts in the response's
``x-taogate-route`` header and the debug log. It is at most ``MAX_CHARS`` characters of ASCII.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Final

from .load import DEFAULT_LOAD, LoadModel, estimate, kv_wait, queued_tokens, slowdown
from .policy import LeastBusy
from .types import InstanceView, RequestFacts, Send

__all__ = ["MAX_CHARS", "Terms", "explain", "render", "terms"]

MAX_CHARS: Final = 600
_NAME_CHARS: Final = 48


@dataclass(frozen=True, slots=True)
class Terms:
    """One candidate's estimate, term by term (seconds), and the hit it assumes (tokens)."""

    name: str
    fixed: float
    queued: float
    own: float
    work: float  # prefill tokens after the hit
    hit: float
    evidence: str
    decode: float
    adjust: float = 0.0
    kv: float = 0.0

    @property
    def total(self) -> float:
        return self.fixed + self.queued + self.own + self.kv + self.decode + self.adjust


def terms(
    view: InstanceView,
    req: RequestFacts,
    hit: float,
    cost: float,
    evidence: str,
    *,
    load: LoadModel = DEFAULT_LOAD,
) -> Terms:
    """Split the estimate of ``req`` on ``view`` with ``hit`` tokens cached (``cost`` as
    ``LeastBusy.price`` gave it: the estimate plus the policy's adjustment) into its terms."""
    work = max(1.0, req.prompt_tokens - hit)
    ttft, latency = estimate(view, work, req.max_tokens, load)
    per_token = slowdown(view, load) / max(view.speed, 1e-9)
    fixed = max(0.0, view.base_latency)
    queued = queued_tokens(view, load) * per_token
    kv = kv_wait(view, load)
    own = max(0.0, ttft - fixed - queued - kv)
    adjust = cost - latency
    return Terms(
        view.name,
        fixed,
        queued,
        own,
        work,
        hit,
        evidence,
        latency - ttft,
        adjust if abs(adjust) > 1e-6 else 0.0,
        kv,
    )


def _clean(name: str) -> str:
    return "".join(c if c.isascii() and c.isprintable() and c not in ";," else "?" for c in name)[
        :_NAME_CHARS
    ]


def _one(t: Terms) -> str:
    text = (
        f"{_clean(t.name)} est={t.total:.3f}s fixed={t.fixed:.3f} queued={t.queued:.3f} "
        f"own={t.own:.3f} ({t.work:.0f} tok, hit {t.hit:.0f} {t.evidence})"
        + (f" kv={t.kv:.3f}" if t.kv else "")
        + f" decode={t.decode:.3f}"
    )
    return text + (f" adjust={t.adjust:+.3f}" if t.adjust else "")


def render(reason: str, chosen: Terms, runner_up: Terms | None) -> str:
    """The receipt's line: the pick and its reason, then the runner-up (at most ``MAX_CHARS``)."""
    line = f"{reason}: {_one(chosen)}"
    line += f"; runner-up {_one(runner_up)}" if runner_up is not None else "; no runner-up"
    return line[:MAX_CHARS]


def explain(
    req: RequestFacts,
    candidates: Sequence[InstanceView],
    send: Send,
    pricer: LeastBusy,
    evidence: Mapping[str, str],
) -> str:
    """The receipt of ``send`` over the ``candidates`` the policy chose among; ``evidence`` names
    each instance's evidence for the request's prefix there (missing: ``none``)."""
    views = list(candidates)
    if not any(v.name == send.instance for v in views):  # overflow: not among the candidates
        return f"{send.reason}: {_clean(send.instance)} (the overflow channel; every primary was full)"
    cached = pricer.uses_cache(req, views)
    hits, _, costs, _ = pricer.price(req, views) if cached else pricer.without_affinity(req, views)
    rows = [
        terms(v, req, hits[j], costs[j], evidence.get(v.name, "none") if cached else "none", load=pricer.load)
        for j, v in enumerate(views)
    ]
    chosen = next(t for t in rows if t.name == send.instance)
    others = [t for t in rows if t.name != send.instance]
    runner_up = min(others, key=lambda t: t.total) if others else None
    return render(send.reason, chosen, runner_up)
