"""The dispatch benchmark's scenario matrix: fleets, caches and traffic that a policy cannot be tuned to.

A ``Cell`` is one fleet and one traffic shape: how many hot prefixes the prompts share (0: none,
mixed traffic), how large the instances' KV caches are against them (roomy; about half the hot
prefixes; about a quarter), which cards are slow and how slow, prefix caching on or off, and how
requests arrive (a closed loop of bursts, Poisson, or on/off bursts). ``QUICK`` samples the matrix
along each axis from a base cell; ``FULL`` crosses more of it. Every row of a cell runs on a fresh
fleet built by ``configs`` from the same workload (``workload``).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, replace
from typing import Literal

from taogate.bench import workloads
from taogate.bench.scenarios import fleet_capacity, fleet_configs
from taogate.bench.workloads import RequestSpec, Workload
from taogate.emulator.config import EmulatorConfig

__all__ = ["FULL", "QUICK", "Cell", "configs", "workload"]

CacheSize = Literal["roomy", "half", "quarter"]
Arrivals = Literal["closed", "poisson", "onoff"]
_FRACTION = {"half": 0.5, "quarter": 0.25}
_TOPICS = ("river", "mountain", "engine", "garden", "market", "library", "harbor", "orchard")


@dataclass(frozen=True, slots=True)
class Cell:
    name: str
    hot: int = 8  # hot prefixes shared by the prompts (0: every prompt unique, mixed sizes)
    prefix_tokens: int = 2000
    question_tokens: int = 40
    requests: int = 160
    instances: int = 4
    slow: tuple[tuple[int, float], ...] = ((3, 2.5),)  # (index, slowdown)
    caching: bool = True
    cache: CacheSize = "roomy"
    arrivals: Arrivals = "closed"
    concurrency: int = 16  # closed loop: requests in flight
    load: float = 0.6  # open loop: offered load, a fraction of the fleet's capacity for this traffic
    max_tokens: int = 16
    seed: int = 0
    max_num_seqs: int | None = None  # the instances' --max-num-seqs (None: the emulator's default)
    cache_info: bool = True  # the instances publish vllm:cache_config_info (their cache's shape)
    hits_after_prefill: bool = False  # engines that make a prompt hittable only once it is prefilled
    plain: bool = False  # plain completion prompts (the shared text, then the question), not chat turns
    header: bool = False  # every text starts with the same instructions (a RAG template), ~400 tokens

    def describe(self) -> str:
        slow = ", ".join(f"i{i} {f:g}x slow" for i, f in self.slow) or "no slow card"
        shape = (
            f"{self.hot} hot prefixes of ~{self.prefix_tokens} tokens" if self.hot else "mixed, no sharing"
        )
        cache = f"caching {'on' if self.caching else 'off'}, {self.cache} cache"
        if self.max_num_seqs is not None:
            cache += f", max-num-seqs {self.max_num_seqs}"
        if not self.cache_info:
            cache += ", no cache_config_info"
        if self.hits_after_prefill:
            cache += ", hits after prefill"
        if self.plain:
            shape += ", plain prompts"
        if self.header:
            shape += " under one header"
        arrive = (
            f"closed loop of {self.concurrency}"
            if self.arrivals == "closed"
            else f"{self.arrivals} at {self.load:.0%}"
        )
        return f"{self.instances} instances ({slow}); {shape}; {cache}; {arrive}; {self.requests} requests"


def _blocks(tokens: float, block_size: int) -> int:
    return math.ceil(tokens / block_size)


def configs(cell: Cell, base: EmulatorConfig | None = None) -> list[EmulatorConfig]:
    """The cell's fleet. A tight cache holds the fraction of the hot prefixes it names (at least
    one whole miss), plus the questions of the requests it runs at once (so nothing is refused)."""
    base = replace(
        base or EmulatorConfig(),
        cache_config_info=cell.cache_info,
        hits_after_prefill=cell.hits_after_prefill,
    )
    if cell.max_num_seqs is not None:
        base = replace(base, max_num_seqs=cell.max_num_seqs)
    if cell.cache != "roomy" and cell.hot:
        bs = base.block_size
        per = cell.prefix_tokens + cell.question_tokens
        one = _blocks(per + cell.max_tokens, bs)
        held = max(_blocks(_FRACTION[cell.cache] * cell.hot * per, bs), one)
        slots = math.ceil(cell.concurrency / cell.instances)
        if cell.max_num_seqs is not None:
            slots = min(slots, cell.max_num_seqs)
        running = slots * _blocks(cell.question_tokens + cell.max_tokens, bs)
        base = replace(base, num_gpu_blocks_override=1 + held + running)
    return fleet_configs(cell.instances, dict(cell.slow), prefix_caching=cell.caching, base=base)


#: Instructions every text starts with in a ``header`` cell: longer than a prefix key's first block.
_HEADER = workloads.filler(400, "Answer from the document below only, and say so when it does not tell.")


def _prefixes(cell: Cell) -> list[str]:
    head = _HEADER + "\n\n" if cell.header else ""
    return [
        f"{head}You are assistant {k}, an expert on the {_TOPICS[k % len(_TOPICS)]}. "
        + workloads.filler(
            cell.prefix_tokens, f"Rule {k}: answer about the {_TOPICS[k % len(_TOPICS)]} briefly."
        )
        for k in range(cell.hot)
    ]


def _rate(cell: Cell) -> float:
    """Requests/s offering ``load`` of the fleet's prefill capacity for this traffic: each request's
    uncached work (with caching on, its question plus a share of prefix prefills) and its decode."""
    capacity = fleet_capacity(configs(cell))
    if not cell.hot:
        tokens = workloads.mixed_mean_tokens()
    elif cell.caching:
        tokens = cell.question_tokens + cell.prefix_tokens * min(
            1.0, cell.hot * cell.instances / cell.requests
        )
    else:
        tokens = cell.prefix_tokens + cell.question_tokens
    return cell.load * capacity / (tokens + 64 * cell.max_tokens)


def _times(cell: Cell, rng: random.Random) -> list[float | None]:
    if cell.arrivals == "closed":
        return [None] * cell.requests
    rate = _rate(cell)
    out: list[float | None] = []
    t = 0.0
    on, off = 1.0, 2.0  # on/off: three times the rate for a second, then two seconds of silence
    while len(out) < cell.requests:
        if cell.arrivals == "poisson":
            t += rng.expovariate(rate)
        else:
            t += rng.expovariate(3 * rate)
            if t % (on + off) > on:
                t += on + off - t % (on + off)
        out.append(t)
    return out


def workload(cell: Cell) -> Workload:
    """The cell's requests: chat turns under a shared system prompt (uniformly drawn), or plain
    prompts that start with it (``plain``), or the mixed workload's unique prompts when there are no
    hot prefixes."""
    rng = random.Random(cell.seed)
    times = _times(cell, rng)
    if not cell.hot:
        mixed = workloads.mixed(cell.requests, 1.0, seed=cell.seed)
        specs = [replace(r, at=at) for r, at in zip(mixed.requests, times, strict=True)]
        return Workload(
            f"cell:{cell.name}", tuple(specs), cell.concurrency if cell.arrivals == "closed" else 512
        )
    prefixes = _prefixes(cell)
    question = workloads.filler(cell.question_tokens, "What should I know?")
    out = []
    for i, at in enumerate(times):
        k = rng.randrange(cell.hot)
        ask = f"Question {i}: {question}"
        out.append(
            RequestSpec(
                i,
                f"{prefixes[k]}\n\n{ask}" if cell.plain else ask,
                cell.max_tokens,
                system=None if cell.plain else prefixes[k],
                group=f"p{k}",
                at=at,
                approx_tokens=cell.prefix_tokens + cell.question_tokens,
            )
        )
    concurrency = cell.concurrency if cell.arrivals == "closed" else 512
    return Workload(f"cell:{cell.name}", tuple(out), concurrency)


_BASE = Cell("base")
_LONG = Cell("long-prompts", hot=1, prefix_tokens=4096, question_tokens=8, requests=64)
#: Closed-loop waves on a cold fleet: 32 clients start together as the gateway becomes ready, the
#: next wave arrives as the first completes; a slow card, 8 slots each, caches holding about half of
#: the 8 hot ~3,000-token system prompts.
_WAVES = Cell(
    "waves, cold, half cache",
    prefix_tokens=3000,
    requests=320,
    concurrency=32,
    cache="half",
    max_num_seqs=8,
)

#: Each axis varied from the base cell, plus the long-prompt load and mixed traffic.
QUICK: tuple[Cell, ...] = (
    _LONG,
    replace(_LONG, name="long-prompts, caching off", caching=False),
    replace(_BASE, name="8 hot, half cache", cache="half"),
    _WAVES,
    replace(_WAVES, name="waves, cold, half cache, no cache_config_info", cache_info=False),
    replace(_WAVES, name="waves, cold, half cache, hits after prefill", hits_after_prefill=True),
    replace(_WAVES, name="waves, cold, half cache, plain prompts", plain=True),
    replace(_WAVES, name="waves, cold, half cache, plain prompts under one header", plain=True, header=True),
    replace(_BASE, name="32 hot, quarter cache", hot=32, cache="quarter", requests=256),
    replace(_BASE, name="8 hot, poisson, 2 slow 4x", arrivals="poisson", slow=((2, 4.0), (3, 4.0))),
    Cell(
        "mixed, poisson", hot=0, caching=False, arrivals="poisson", load=0.7, requests=480, slow=((3, 2.5),)
    ),
)


def _full() -> tuple[Cell, ...]:
    cells = list(QUICK)
    for cache in ("roomy", "half", "quarter"):
        for hot in (8, 32):
            cells.append(replace(_BASE, name=f"{hot} hot, {cache} cache", hot=hot, cache=cache, requests=256))
    for factor in (1.5, 4.0):
        cells.append(replace(_BASE, name=f"8 hot, slow {factor:g}x", slow=((3, factor),)))
    cells.append(replace(_BASE, name="8 hot, no slow card", slow=()))
    cells.append(replace(_BASE, name="8 hot, 8 instances, 2 slow", instances=8, slow=((6, 2.5), (7, 2.5)),
                         concurrency=32, requests=256))  # fmt: skip
    for arrivals in ("poisson", "onoff"):
        cells.append(replace(_BASE, name=f"8 hot, half cache, {arrivals}", cache="half", arrivals=arrivals))
        cells.append(replace(_LONG, name=f"long-prompts, {arrivals}", arrivals=arrivals, load=0.7))
    cells.append(replace(_BASE, name="8 hot, caching off", caching=False))
    cells.append(Cell("mixed, onoff", hot=0, caching=False, arrivals="onoff", load=0.7, requests=480))
    cells.append(replace(_LONG, name="long-prompts, no slow card", slow=()))
    return tuple(cells)


FULL: tuple[Cell, ...] = _full()
