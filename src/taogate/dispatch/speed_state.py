"""What ``SpeedEstimator`` learns and keeps per instance (see ``speed``), and what it reports of it."""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["SpeedStat", "State"]


class SpeedStat(NamedTuple):
    speed: float  # prompt tokens per second of prefill
    samples: int  # samples taken
    evidence: float  # samples weighted by the work they covered: full-size-sample equivalents
    spread: float = 0.0  # how far one sample's log speed strays from the estimate (0: unknown yet)


class State:
    __slots__ = (
        "base",
        "base_n",
        "dev2",
        "dev_n",
        "engine",
        "evidence",
        "guessed",
        "held",
        "log_speed",
        "n",
        "taught",
        "tpot",
        "tpot_n",
        "uncached_ratio",
        "weight",
    )

    def __init__(self, log_speed: float, weight: float, tpot: float, base: float) -> None:
        self.log_speed = log_speed
        self.weight = weight
        self.n = 0
        self.evidence = 0.0
        self.dev2 = 0.0  # running mean of a sample's squared log deviation from the estimate
        self.dev_n = 0  # samples it has seen
        self.tpot = tpot  # seconds per output token while decoding
        self.tpot_n = 0  # decode-pace samples seen
        self.uncached_ratio = 1.0  # recent uncached / prompt tokens: what prefix caching leaves to do
        self.base = base  # fixed part of a TTFT (seconds), learned from small-work samples
        self.base_n = 0  # small-work samples seen
        self.engine = False  # the instance reports its own phase times: learn from those only
        self.guessed = False  # learned from a sample that could have hit the cache (not a salted warm-up)
        self.taught = 0  # requests learned from one by one since the last engine window
        # (ttft, own, work) of first tokens waiting for the engine's next window to vouch for them
        self.held: list[tuple[float, float, float]] = []
