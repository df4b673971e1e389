"""Workloads: what to send, as plain data (``RequestSpec`` rows inside a ``Workload``).

Prompt sizes are approximate on purpose: a real fleet's tokenizer is unknown here. The filler sentence
below is 10 tokens under the emulator's rule (words and punctuation) and 45 characters (~11 tokens at
the usual ~4 characters per token), so "N tokens" means "N // 10 sentences" on both. Builders:

- ``single``: one ~4,096-token prompt (a sentence repeated ~400 times); with a small ``max_tokens``
  its latency approximates TTFT.
- ``long_prompts``: 64 such prompts, 16 at a time, ``max_tokens`` 16, each with a unique
  "request number i" suffix (the shared body is what prefix caching can reuse).
- ``mixed``: 80% ~200-token / 20% ~8,000-token prompts, Poisson arrivals at ``rate`` requests/s; every
  prompt starts with its own number so no two share a cacheable prefix.
- ``shared_prefix``: 8 long system prompts, many short questions (chat requests).
- ``from_file``: a user's JSONL file: one prompt per line, a JSON string or an object
  ``{"prompt": ..., "max_tokens"?: int, "system"?: str, "group"?: str}``.

``salted`` and ``unshared`` put fresh prefixes in front, per run and per request (see there).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import orjson

__all__ = [
    "SENTENCE",
    "RequestSpec",
    "Workload",
    "filler",
    "from_file",
    "long_prompts",
    "mixed",
    "mixed_mean_tokens",
    "salted",
    "shared_prefix",
    "single",
    "unshared",
]

SENTENCE = "The quick brown fox jumps over the lazy dog."
_SENTENCE_TOKENS = 10
_TOPICS = ("river", "mountain", "engine", "garden", "market", "library", "harbor", "orchard")


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """One request: a completion prompt, or a chat turn when ``system`` is set."""

    index: int
    prompt: str
    max_tokens: int
    system: str | None = None
    group: str = ""  # a label to split results by ("short"/"long", "sys3", ...)
    at: float | None = None  # open loop: seconds after the run starts; None = as soon as a slot frees
    approx_tokens: int = 0


@dataclass(frozen=True, slots=True)
class Workload:
    """Requests plus how many may be in flight at once (closed loop unless requests carry ``at``)."""

    name: str
    requests: tuple[RequestSpec, ...]
    concurrency: int

    def __post_init__(self) -> None:
        if self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")

    def limited(self, max_requests: int | None) -> Workload:
        """The first ``max_requests`` requests (the safety cap)."""
        if max_requests is None or max_requests >= len(self.requests):
            return self
        return replace(self, requests=self.requests[: max(0, max_requests)])

    @property
    def prompt_tokens(self) -> int:
        return sum(r.approx_tokens for r in self.requests)


def filler(tokens: int, sentence: str = SENTENCE) -> str:
    """About ``tokens`` tokens of text: the sentence repeated (~400 times for 4,096 tokens)."""
    return " ".join([sentence] * max(1, round(tokens / _SENTENCE_TOKENS)))


def single(prompt_tokens: int = 4096, max_tokens: int = 16) -> Workload:
    """One long prompt; its latency approximates TTFT when ``max_tokens`` is small."""
    spec = RequestSpec(0, filler(prompt_tokens), max_tokens, group="single", approx_tokens=prompt_tokens)
    return Workload("single", (spec,), 1)


def long_prompts(
    requests: int = 64, concurrency: int = 16, prompt_tokens: int = 4096, max_tokens: int = 16
) -> Workload:
    """``requests`` long prompts, ``concurrency`` at a time, each with a unique suffix."""
    body = filler(prompt_tokens)
    specs = tuple(
        RequestSpec(
            i, f"{body} request number {i}", max_tokens, group="long-prompts", approx_tokens=prompt_tokens
        )
        for i in range(requests)
    )
    return Workload("long-prompts", specs, concurrency)


def mixed_mean_tokens(short_tokens: int = 200, long_tokens: int = 8000, long_fraction: float = 0.2) -> float:
    """Mean prompt size of the mixed workload (to turn a token budget into a request rate)."""
    return (1 - long_fraction) * short_tokens + long_fraction * long_tokens


def mixed(
    requests: int = 200,
    rate: float = 10.0,
    *,
    short_tokens: int = 200,
    long_tokens: int = 8000,
    long_fraction: float = 0.2,
    max_tokens: int = 16,
    concurrency: int = 512,
    seed: int = 0,
) -> Workload:
    """Short and long prompts mixed, Poisson arrivals at ``rate`` requests/s (exponential gaps)."""
    if rate <= 0:
        raise ValueError(f"rate must be > 0, got {rate}")
    rng = random.Random(seed)
    short_body, long_body = filler(short_tokens), filler(long_tokens)
    specs = []
    t = 0.0
    for i in range(requests):
        t += rng.expovariate(rate)
        is_long = rng.random() < long_fraction
        body, size = (long_body, long_tokens) if is_long else (short_body, short_tokens)
        # The number goes first: mixed traffic must not share cacheable prefixes.
        specs.append(
            RequestSpec(
                i,
                f"Request {i} of a mixed load. {body}",
                max_tokens,
                group="long" if is_long else "short",
                at=t,
                approx_tokens=size,
            )
        )
    return Workload("mixed", tuple(specs), concurrency)


def shared_prefix(
    requests: int = 128,
    concurrency: int = 16,
    *,
    systems: int = 8,
    system_tokens: int = 2000,
    question_tokens: int = 40,
    max_tokens: int = 16,
    seed: int = 0,
) -> Workload:
    """``systems`` long system prompts, each shared by many short questions, in random order."""
    rng = random.Random(seed)
    prompts = [
        f"You are assistant {k}, an expert on the {_TOPICS[k % len(_TOPICS)]}. "
        + filler(system_tokens, f"Rule {k}: answer questions about the {_TOPICS[k % len(_TOPICS)]} briefly.")
        for k in range(systems)
    ]
    question = filler(question_tokens, "What should I know?")
    specs = []
    for i in range(requests):
        k = rng.randrange(systems)
        specs.append(
            RequestSpec(
                i,
                f"Question {i}: {question}",
                max_tokens,
                system=prompts[k],
                group=f"sys{k}",
                approx_tokens=system_tokens + question_tokens,
            )
        )
    return Workload("shared-prefix", tuple(specs), concurrency)


def salted(workload: Workload, salt: str) -> Workload:
    """The same workload with ``salt`` in front of every prompt (a fresh prefix: nothing an earlier
    run left in a prefix cache is reused; prompts still share what they shared with each other)."""

    def one(spec: RequestSpec) -> RequestSpec:
        if spec.system is not None:
            return replace(spec, system=f"{salt} {spec.system}")
        return replace(spec, prompt=f"{salt} {spec.prompt}")

    return replace(workload, requests=tuple(one(s) for s in workload.requests))


def unshared(workload: Workload, salt: str) -> Workload:
    """Every request behind a salt of its own: no two prompts share a prefix, so no prefix cache can
    make some requests cheaper than others (what a comparison between instances must rule out)."""
    return replace(
        workload,
        requests=tuple(
            replace(s, system=f"{salt}-{s.index} {s.system}")
            if s.system is not None
            else replace(s, prompt=f"{salt}-{s.index} {s.prompt}")
            for s in workload.requests
        ),
    )


def _file_spec(index: int, row: Any, max_tokens: int) -> RequestSpec:
    if isinstance(row, str):
        row = {"prompt": row}
    if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
        raise ValueError('expected a JSON string or an object with a "prompt" string')
    system = row.get("system")
    prompt: str = row["prompt"]
    return RequestSpec(
        index,
        prompt,
        int(row.get("max_tokens", max_tokens)),
        system=system if isinstance(system, str) else None,
        group=str(row.get("group", "file")),
        approx_tokens=(len(prompt) + len(system or "")) // 4,
    )


def from_file(path: Path, concurrency: int = 16, max_tokens: int = 16) -> Workload:
    """Prompts from a JSONL file (blank lines skipped); sizes estimated at ~4 characters per token."""
    specs: list[RequestSpec] = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.strip():
            try:
                row = orjson.loads(line)
                specs.append(_file_spec(len(specs), row, max_tokens))
            except (orjson.JSONDecodeError, ValueError, TypeError) as exc:
                raise ValueError(f"{path}: line {number}: {exc}") from None
    if not specs:
        raise ValueError(f"{path}: no prompts")
    return Workload(f"file:{path.name}", tuple(specs), concurrency)
